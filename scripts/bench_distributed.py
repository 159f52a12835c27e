"""One model over two ranks (mx.distributed, ring backend on loopback) vs one process, side by side.

For each model: the same server run as one process and as two ranks under `mlx.launch`
(`--distributed tensor` where mlx-lm can shard the model by heads, else `pipeline`). Measured per
server: TTFT cold (a new system prompt), on a RAM hit (the same chat again) and on an SSD hit
after restarting the server (every rank), with the cached tokens each reports; for the two-rank
server also the engine's own collectives per request (the update rank 0 shares each step, the
agreement on the cached length, /health's gathers) in count and milliseconds, from /health.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_distributed.py [--quick]

On this 2-core machine two ranks share the cores, so the two-rank TTFTs measure the protocol's
overhead, not a speed-up: the point of ranks is memory (a model bigger than one machine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import ROOT
from harness.clients import stream_chat
from harness.prompts import system_prompt
from harness.reports import median, write_report
from harness.servers import Server, free_port
from harness.synthetic import base_vocab_size, random_model, write_model_folder

from mlx_kvserve.cpu.blas import preload_env

MODELS = {
    # name: (config, mode). The tiny llama splits by heads; a SmolLM2-shaped qwen2 (9 heads: no
    # even head split) runs as a pipeline (mlx-lm 0.32.2's llama has no pipeline; its qwen2 has).
    "tiny-llama": (
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128},
        "tensor",
        {"num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    "smollm2-shaped-qwen2": (
        {"model_type": "qwen2", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536},
        "pipeline",
        {"num_attention_heads": 9, "num_key_value_heads": 3},
    ),
}


def build(folder: Path, name: str) -> tuple[Path, str]:
    shape, mode, heads = MODELS[name]
    config = {
        **shape,
        **heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": base_vocab_size(),
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": [2],
    }
    if not (folder / "model.safetensors").exists():
        write_model_folder(folder, config, random_model(config, scale=4.0))
    return folder, mode


class LaunchedServer(Server):
    """A server run under `mlx.launch`: stopped by signalling every rank (SIGTERM to rank 0 first,
    so the stop reaches the others through the shared update), since the launcher does not
    forward a SIGTERM to the ranks."""

    def stop(self) -> None:
        import signal
        import subprocess

        ranks = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            self.proc.kill()


def servers_for(model_dir: Path, mode: str) -> list[Server]:
    env = preload_env({**os.environ, "PYTHONUNBUFFERED": "1"})
    run = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model_dir)]
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    one_port, two_port = free_port(), free_port()
    one = Server(
        "one process",
        [*run, "--port", str(one_port)],
        one_port,
        {**env, "MLX_KVSERVE_HOME": tempfile.mkdtemp(prefix="dist-one-")},
        "/health",
    )
    two = LaunchedServer(
        f"two ranks ({mode})",
        [launcher, "-n", "2", "--backend", "ring", "--", *run, "--port", str(two_port), "--distributed", mode],
        two_port,
        {**env, "MLX_KVSERVE_HOME": tempfile.mkdtemp(prefix="dist-two-")},
        "/health",
    )
    return [one, two]


def world_stats(server: Server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()["cache"].get("world", {})


def measure(server: Server, reps: int, words: int) -> dict:
    server.wait("/health")
    stream_chat(server, [{"role": "user", "content": "warm up"}], 4)
    before = world_stats(server)
    row: dict = {"cold": [], "ram_hit": [], "ssd_hit": [], "cached": {}}
    chats = []
    for rep in range(reps):
        messages = [
            {"role": "system", "content": system_prompt(f"{server.name}-{rep}-{time.time()}", words)},
            {"role": "user", "content": "Which river is the longest?"},
        ]
        chats.append(messages)
        row["cold"].append(stream_chat(server, messages, 8).ttft_s)
        hit = stream_chat(server, messages, 8)
        row["ram_hit"].append(hit.ttft_s)
        row["cached"]["ram_hit"] = hit.cached_tokens
    after = world_stats(server)
    requests = 2 * reps
    if after:
        row["collectives_per_request"] = (after["collectives"] - before["collectives"]) / requests
        row["collective_ms_per_request"] = 1000 * (after["collective_s"] - before["collective_s"]) / requests
    server.restart()
    for messages in chats:
        hit = stream_chat(server, messages, 8)
        row["ssd_hit"].append(hit.ttft_s)
        row["cached"]["ssd_hit"] = hit.cached_tokens
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one rep, a shorter system prompt")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "distributed")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    reps, words = (1, 300) if args.quick else (3, 880)
    results: dict = {}
    lines = [
        "| model | server | cold TTFT (s) | RAM hit (s) | SSD hit after restart (s) | cached (RAM / SSD) | "
        "collectives per request | their ms per request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        folder, mode = build(ROOT / "results" / "models" / name, name)
        servers = servers_for(folder, mode)
        try:
            for server in servers:
                row = measure(server, reps, words)
                results.setdefault(name, {})[server.name] = row
                cached = row["cached"]
                lines.append(
                    f"| {name} | {server.name} | {median(row['cold']):.3f} | {median(row['ram_hit']):.3f} | "
                    f"{median(row['ssd_hit']):.3f} | {cached.get('ram_hit')} / {cached.get('ssd_hit')} | "
                    f"{row.get('collectives_per_request', '–')} | "
                    + (f"{row['collective_ms_per_request']:.1f} |" if "collective_ms_per_request" in row else "– |")
                )
                server.stop()
        finally:
            for server in servers:
                server.stop()
    write_report(results, args.out, lines)


if __name__ == "__main__":
    main()
