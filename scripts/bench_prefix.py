"""TTFT side by side: mlx-kvserve vs mlx_lm.server on the same model, in one run.

Scenarios (chat, ~1.2k-token system prompt, greedy): cold, exact repeat, new question, and a
16-turn conversation (TTFT per turn). Both servers run with the same BLAS; requests alternate
between them and only one server is busy at a time. Also decode tokens/s of our engine vs plain
mlx-lm `stream_generate` on the same prompt, in-process.
Usage: python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_prefix.py [--quick] [--out results/prefix]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from bench_common import QUESTIONS, ROOT, default_model_dir, median, system_prompt, write_report

from mlx_kvserve.blas import preload_env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], ready_path: str):
        self.name, self.port, self.cmd, self.env, self.ready_path = name, port, cmd, env, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        self.stop()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(self.ready_path)

    def wait(self, path: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class ChatReply(NamedTuple):
    ttft_s: float  # seconds to the first content token
    text: str
    cached_tokens: int | None  # as reported in usage, None when not reported
    completion_tokens: int


def stream_chat(server: Server, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> ChatReply:
    """One streamed greedy chat completion, timed from the request to its first content token."""
    body = {
        "model": "default" if server.name == "mlx-kvserve" else None,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body = {k: v for k, v in body.items() if v is not None}
    start = time.perf_counter()
    first, text, cached, completion = None, [], None, 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=timeout_s) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter() - start
                    text.append(piece)
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                completion = usage.get("completion_tokens") or 0
    ttft = first if first is not None else time.perf_counter() - start
    return ChatReply(ttft, "".join(text), cached, completion)


def chat_ttft(server: Server, messages: list[dict], max_tokens: int = 8) -> tuple[float, str, int | None]:
    """(seconds to the first content token, full text, cached tokens reported or None)."""
    reply = stream_chat(server, messages, max_tokens)
    return reply.ttft_s, reply.text, reply.cached_tokens


def scenario_system_prompt(servers: list[Server], reps: int, words: int = 880) -> dict:
    """Cold, exact repeat and a new question on a ~`words`-word system prompt (880: ~1.2k tokens)."""
    out = {s.name: {"cold": [], "repeat": [], "new_question": [], "cached": {}} for s in servers}
    for rep in range(reps):
        for server in servers:  # each server gets its own unique (cold) system prompt
            system = system_prompt(nonce=f"{server.name}-{rep}-{time.time()}", target_words=words)

            def ask(q: str, system: str = system) -> list[dict]:
                return [{"role": "system", "content": system}, {"role": "user", "content": q}]

            row = out[server.name]
            t, _, _ = chat_ttft(server, ask(QUESTIONS[0]))
            row["cold"].append(t)
            t, _, c = chat_ttft(server, ask(QUESTIONS[0]))
            row["repeat"].append(t)
            row["cached"]["repeat"] = c
            t, _, c = chat_ttft(server, ask(QUESTIONS[1 + rep % 3]))
            row["new_question"].append(t)
            row["cached"]["new_question"] = c
            print(server.name, {k: round(v[-1], 3) for k, v in row.items() if isinstance(v, list)}, flush=True)
    return {name: {k: median(v) if isinstance(v, list) else v for k, v in row.items()} for name, row in out.items()}


def scenario_restart(servers: list[Server], reps: int) -> dict:
    """Cold request, restart the server, the same request again: ours from the SSD, theirs cold."""
    out = {}
    for server in servers:
        cold, after = [], []
        for rep in range(reps):
            system = system_prompt(nonce=f"restart-{server.name}-{rep}-{time.time()}")
            messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
            cold.append(chat_ttft(server, messages)[0])
            server.restart()
            chat_ttft(server, [{"role": "user", "content": "warm up"}], 2)  # kernel compilation after start
            t, _, cached = chat_ttft(server, messages)
            after.append(t)
        out[server.name] = {"cold": median(cold), "after_restart": median(after), "cached_after_restart": cached}
        print(server.name, "restart", out[server.name], flush=True)
    return out


def scenario_conversation(servers: list[Server], turns: int) -> dict:
    out = {}
    for server in servers:
        messages = [{"role": "system", "content": system_prompt(nonce=f"conv-{server.name}-{time.time()}")}]
        ttfts = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn + 1}: {QUESTIONS[turn % len(QUESTIONS)]}"})
            t, text, _ = chat_ttft(server, messages, max_tokens=24)
            messages.append({"role": "assistant", "content": text})
            ttfts.append(t)
        out[server.name] = ttfts
        print(server.name, "conversation TTFT per turn", [round(t, 2) for t in ttfts], flush=True)
    return out


def decode_speed(model_dir: Path, reps: int, max_tokens: int) -> dict:
    """Decode tokens/s of our Generator vs mlx_lm.stream_generate on the same prompt, alternating."""
    from mlx_lm import stream_generate
    from mlx_lm.utils import load

    sys.path.insert(0, str(ROOT / "tests"))
    from kvharness import make_generator

    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

    model, tokenizer = load(str(model_dir))
    messages = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper who finds a map."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ours, theirs = [], []
    for _ in range(reps):
        gen = make_generator(model, tokenizer, 64)
        events, stamps = [], []

        def emit(event, events=events, stamps=stamps):
            events.append(event)
            stamps.append(time.perf_counter())

        req = GenerationRequest("d", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), emit)
        start = time.perf_counter()
        gen.run(req)
        done = events[-1]
        assert isinstance(done, Finished)
        # Block registration runs after the Finished event: it is not decode time.
        decode_s = stamps[-1] - start - done.first_token_s
        ours.append((done.usage.completion_tokens - 1) / decode_s)
        *_, last = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
        theirs.append(last.generation_tps)
        print(
            f"decode: ours {ours[-1]:.1f} tok/s ({done.usage.completion_tokens} tokens), mlx-lm {theirs[-1]:.1f} tok/s ({last.generation_tokens} tokens)",
            flush=True,
        )
    return {"ours_tps": median(ours), "mlx_lm_tps": median(theirs), "ratio": median(ours) / median(theirs)}


def ssd_write_cost(model_dir: Path, reps: int, max_tokens: int) -> dict:
    """What write-through costs the requests that run while the writer is busy. A request
    registers ~20 new blocks; right after it come a cache hit (a new question on the same system
    prompt: TTFT) and a long decode (tokens/s). Modes: the SSD tier off; on, with writes held
    while a request prefills ([ssd] write_hold_s, the default); on, never held."""
    from mlx_lm.utils import load

    sys.path.insert(0, str(ROOT / "tests"))
    from kvharness import close_ssd, make_generator

    from mlx_kvserve.config import SSDConfig
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

    model, tokenizer = load(str(model_dir))
    modes = {"off": None, "on": SSDConfig().write_hold_s, "on_no_hold": 0.0}

    def chat(system: str, question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def run(gen, prompt, tokens) -> tuple[Finished, float]:
        """(Finished, seconds from start to the last event)."""
        events, stamps = [], []

        def emit(event, events=events, stamps=stamps):
            events.append(event)
            stamps.append(time.perf_counter())

        start = time.perf_counter()
        gen.run(GenerationRequest("w", prompt, SamplingParams(max_tokens=tokens, temperature=0.0), emit))
        return events[-1], stamps[-1] - start

    tps: dict[str, list[float]] = {mode: [] for mode in modes}
    hit: dict[str, list[float]] = {mode: [] for mode in modes}
    story = chat("You are a storyteller.", "Write a long, detailed story about a lighthouse keeper.")
    for rep in range(reps):
        for mode, hold in modes.items():
            ssd_dir = Path(tempfile.mkdtemp(prefix="kvserve-ssdcost-")) if hold is not None else None
            gen = make_generator(model, tokenizer, 64, ssd_dir=ssd_dir, write_hold_s=hold or 0.0)
            system = system_prompt(f"{mode}-{rep}-{time.time()}")
            run(gen, chat(system, QUESTIONS[0]), 1)
            done, _ = run(gen, chat(system, QUESTIONS[1]), 1)
            hit[mode].append(done.first_token_s)
            done, total = run(gen, story, max_tokens)
            tps[mode].append((done.usage.completion_tokens - 1) / (total - done.first_token_s))
            if ssd_dir is not None:
                close_ssd(gen)
            print(f"ssd write cost {mode}: hit TTFT {hit[mode][-1]:.3f}s, decode {tps[mode][-1]:.2f} tok/s", flush=True)
    on, off, no_hold = median(tps["on"]), median(tps["off"]), median(tps["on_no_hold"])
    return {
        "decode_tps_ssd_off": off,
        "decode_tps_ssd_on": on,
        "decode_tps_ssd_on_no_hold": no_hold,
        "ratio": on / off,
        "hit_ttft_ssd_off": median(hit["off"]),
        "hit_ttft_ssd_on": median(hit["on"]),
        "hit_ttft_ssd_on_no_hold": median(hit["on_no_hold"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results" / "prefix"))
    parser.add_argument("--scenarios", default="system,restart,conversation,decode,ssd", help="comma-separated subset")
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument(
        "--system-words", type=int, default=880, help="system scenario prompt words (880: ~1.2k tokens)"
    )
    args = parser.parse_args()
    wanted = set(args.scenarios.split(","))
    reps, turns = (1, 6) if args.quick else (3, 16)
    model_dir = Path(args.model) if args.model else default_model_dir()
    env = preload_env(dict(os.environ, PYTHONUNBUFFERED="1"))
    home = tempfile.mkdtemp(prefix="kvserve-bench-")
    ours_port, theirs_port = free_port(), free_port()
    ours = Server(
        "mlx-kvserve",
        [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model_dir), "--port", str(ours_port)],
        ours_port,
        dict(env, MLX_KVSERVE_HOME=home),
        "/health",
    )
    theirs = Server(
        "mlx_lm.server",
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(theirs_port)],
        theirs_port,
        env,
        "/v1/models",
    )
    try:
        ours.wait(ours.ready_path)
        theirs.wait(theirs.ready_path)
        servers = [ours, theirs]
        chat_ttft(ours, [{"role": "user", "content": "warm up"}], 4)  # first-use kernel compilation
        chat_ttft(theirs, [{"role": "user", "content": "warm up"}], 4)
        results = {}
        if "system" in wanted:
            results["system_prompt"] = scenario_system_prompt(servers, reps, args.system_words)
        if "restart" in wanted:
            results["restart"] = scenario_restart(servers, reps)
        if "conversation" in wanted:
            results["conversation"] = scenario_conversation(servers, turns)
    finally:
        ours.stop()
        theirs.stop()
    if "decode" in wanted:
        results["decode"] = decode_speed(model_dir, reps, 64 if args.quick else 128)
    if "ssd" in wanted:
        results["ssd_write_cost"] = ssd_write_cost(model_dir, reps, 64 if args.quick else 128)
    write_report(results, Path(args.out), report_lines(results))


def report_lines(results: dict) -> list[str]:
    """Markdown for whichever of this script's scenarios are in `results`."""
    lines: list[str] = []
    if "system_prompt" in results:
        a, b = results["system_prompt"]["mlx-kvserve"], results["system_prompt"]["mlx_lm.server"]
        lines += [
            "| scenario | mlx-kvserve TTFT s | mlx_lm.server TTFT s | ratio (theirs / ours) |",
            "|---|---|---|---|",
        ]
        for key in ("cold", "repeat", "new_question"):
            lines.append(f"| {key.replace('_', ' ')} | {a[key]:.3f} | {b[key]:.3f} | {b[key] / a[key]:.2f}x |")
        lines.append(
            f"\nOurs: hit/cold = 1/{a['cold'] / a['repeat']:.1f} (repeat), 1/{a['cold'] / a['new_question']:.1f} "
            f"(new question); cached tokens {a['cached']}"
        )
    if "restart" in results:
        ra, rb = results["restart"]["mlx-kvserve"], results["restart"]["mlx_lm.server"]
        lines += [
            "",
            "| first request after a restart | mlx-kvserve | mlx_lm.server |",
            "|---|---|---|",
            f"| cold TTFT s | {ra['cold']:.3f} | {rb['cold']:.3f} |",
            f"| after restart TTFT s | {ra['after_restart']:.3f} | {rb['after_restart']:.3f} |",
            f"| after restart / cold | 1/{ra['cold'] / ra['after_restart']:.1f} | 1/{rb['cold'] / rb['after_restart']:.1f} |",
            f"| cached tokens after restart | {ra['cached_after_restart']} | - |",
        ]
    if "conversation" in results:
        ours_turns, their_turns = results["conversation"]["mlx-kvserve"], results["conversation"]["mlx_lm.server"]
        lines += ["", "| turn | mlx-kvserve TTFT s | mlx_lm.server TTFT s |", "|---|---|---|"]
        lines += [
            f"| {i + 1} | {x:.3f} | {y:.3f} |" for i, (x, y) in enumerate(zip(ours_turns, their_turns, strict=True))
        ]
    if "decode" in results:
        dec = results["decode"]
        lines.append(
            f"\nDecode: ours {dec['ours_tps']:.1f} tok/s, mlx-lm stream_generate {dec['mlx_lm_tps']:.1f} tok/s, "
            f"ratio {dec['ratio']:.3f}"
        )
    if "ssd_write_cost" in results:
        w = results["ssd_write_cost"]
        lines.append(
            f"\nDecode right after a request that wrote ~20 blocks: SSD off {w['decode_tps_ssd_off']:.1f} tok/s, "
            f"on {w['decode_tps_ssd_on']:.1f} tok/s, ratio {w['ratio']:.3f} "
            f"(on without write_hold_s: {w['decode_tps_ssd_on_no_hold']:.1f} tok/s)"
        )
        lines.append(
            f"\nTTFT of a cache hit right after that request: SSD off {w['hit_ttft_ssd_off']:.3f} s, "
            f"on {w['hit_ttft_ssd_on']:.3f} s, on without write_hold_s {w['hit_ttft_ssd_on_no_hold']:.3f} s"
        )
    return lines


if __name__ == "__main__":
    main()
