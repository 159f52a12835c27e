"""Images cached like text, side by side with mlx-vlm's own server, in one run on a tiny random-weight
VLM (make_tiny_vlm.py; Qwen2-VL by default) served over HTTP by both (OpenAI chat, streamed, greedy):

1. a first question about an image (cold), then a second question about the same image;
2. a conversation whose fourth turn re-sends its 3 earlier images (each earlier turn added one);
3. the second question again as the first request after a restart of both servers (our SSD tier;
   mlx-vlm's APC disk tier, on with APC_ENABLED=1).

For each: time to first token (median of --reps fresh images), prompt and cached tokens as each server
reports them, and (ours) vision-tower runs. The machine's load average is printed with the figures;
compare the two servers by their ratio, measured in the same run.

mlx_vlm.server needs fastapi, mlx-audio and cryptography, which the project's venv does not hold:
install them into a folder of their own (`pip install --target DIR fastapi cryptography` and
`pip install --target DIR --no-deps mlx-audio`) and pass it as --peer-path (put on PYTHONPATH for
mlx-vlm's server only).

    python scripts/bench_vision.py --peer-path /tmp/peer [--family qwen2_vl] [--image-size 448]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import OURS  # noqa: E402
from harness.servers import Server, free_port, server_env  # noqa: E402
from harness.tiny_vlm import build  # noqa: E402

PEER = "mlx_vlm.server (APC on)"


def data_url(seed: int, size: tuple[int, int] = (480, 640)) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.clip(rng.integers(0, 256, 3) + rng.normal(0, 20, (*size, 3)), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, images: list[str]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def ask(server: Server, model: str, messages: list[dict]) -> dict:
    """One streamed greedy request: TTFT (ms), prompt and cached tokens as the server reports them."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, usage = None, {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    ttft = first if first is not None else time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_ms": ttft * 1000, "prompt": usage.get("prompt_tokens"), "cached": details.get("cached_tokens")}


def encodes(server: Server) -> int | None:
    if server.name != OURS:
        return None
    return httpx.get(server.url + "/health", timeout=10).json()["vision"]["image_encodes"]


def start(folder: Path, peer_path: str, image_size: int) -> list[Server]:
    env = server_env()
    home = tempfile.mkdtemp(prefix="kvserve-vision-")
    port = free_port()
    ours = Server(
        OURS,
        [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(folder), "--port", str(port)],
        port,
        dict(env, MLX_KVSERVE_HOME=home),
        "/health",
    )
    peer_env = dict(env, PYTHONPATH=peer_path, APC_ENABLED="1", APC_DISK_PATH=tempfile.mkdtemp(prefix="apc-"))
    port = free_port()
    pixels = str(image_size * image_size)
    cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", str(folder), "--port", str(port)]
    if folder.joinpath("config.json").read_text().count('"qwen2_vl"'):  # the same image sizes as ours
        cmd += ["--max-pixels", pixels]
    theirs = Server(PEER, cmd, port, peer_env, "/health")
    try:
        for s in (ours, theirs):
            s.wait(s.ready_path)
    except BaseException:
        ours.stop()
        theirs.stop()
        raise
    return [ours, theirs]


def scenarios(servers: list[Server], folder: Path, seed: int) -> dict[str, dict[str, dict]]:
    """Rows of one repetition (fresh images from `seed` on): scenario -> server -> figures."""
    models = {OURS: "default", PEER: str(folder)}
    a, b, c, d = (data_url(seed + i) for i in range(4))
    rows: dict[str, dict[str, dict]] = {}

    def measure(name: str, messages: list[dict]) -> None:
        for s in servers:
            before = encodes(s)
            r = ask(s, models[s.name], messages)
            r["encodes"] = None if before is None else encodes(s) - before
            rows.setdefault(name, {})[s.name] = r

    measure("1. first question, image A (cold)", [user("What is in this picture?", [a])])
    measure("1. second question, same image A", [user("What colour dominates it?", [a])])
    turns: list[dict] = []
    for i, img in enumerate((b, c, d)):  # turns 1-3, a new image each: sent, not measured
        turns += [user(f"Screenshot {i + 1}: what changed?", [img])]
        for s in servers:
            ask(s, models[s.name], turns)
        turns += [{"role": "assistant", "content": f"Reply {i + 1}."}]
    turns += [user("Which of the three is darkest?", [])]
    measure("2. turn 4 re-sends images B, C, D", turns)
    for s in servers:
        s.restart()
    measure("3. after restart: second question, image A", [user("What colour dominates it?", [a])])
    return rows


def report(reps: list[dict[str, dict[str, dict]]], servers: list[Server], load: tuple) -> None:
    names = [s.name for s in servers]
    avg = " / ".join(f"{a:.2f}, {b:.2f}, {c:.2f}" for a, b, c in load)
    print(f"load average (1, 5, 15 min) before / after: {avg}; medians of {len(reps)} repetitions")
    print(f"columns per server ({' | '.join(names)}): TTFT ms, prompt tokens, cached tokens, image encodes (ours)")
    print(f"{'scenario':<44}" + "| ttft_ms prompt cached enc " * len(names) + "| theirs/ours TTFT")
    for scenario in reps[0]:
        line = f"{scenario:<44}"
        ttft = {}
        for n in names:
            rs = [rep[scenario][n] for rep in reps]
            ttft[n] = statistics.median(r["ttft_ms"] for r in rs)
            last = rs[-1]
            enc = "-" if last["encodes"] is None else str(last["encodes"])
            line += f"| {ttft[n]:7.1f} {last['prompt']!s:>6} {last['cached']!s:>6} {enc:>3} "
        print(line + f"| {ttft[names[1]] / ttft[names[0]]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # gemma3: mlx_vlm.server 0.7.10 fails to load the tiny Gemma 3 (its processor wants boi_token_id).
    parser.add_argument("--family", choices=("qwen2_vl", "gemma3"), default="qwen2_vl")
    parser.add_argument("--image-size", type=int, default=448, help="qwen2_vl: images fit in its square's pixels")
    parser.add_argument("--peer-path", default=os.environ.get("MLX_VLM_SERVER_DEPS", ""))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "model", args.family, image_size=args.image_size)
        servers = start(folder, args.peer_path, args.image_size)
        try:
            models = {OURS: "default", PEER: str(folder)}
            for s in servers:  # first-use kernel compilation, on an image no scenario uses
                ask(s, models[s.name], [user("Warm-up.", [data_url(999)])])
            reps = [scenarios(servers, folder, 100 * (i + 1)) for i in range(args.reps)]
        finally:
            for s in servers:
                s.stop()
    report(reps, servers, (load_before, os.getloadavg()))


if __name__ == "__main__":
    main()
