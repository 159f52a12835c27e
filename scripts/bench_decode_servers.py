"""Decode speed and a request timeline, our server next to `mlx_lm.server` and (with --vllm-mlx) vllm-mlx.

- decode: C clients at once (C in --clients, default 1 and 4), each a short prompt of its own asking for
  a long answer, `--max-tokens` greedy tokens; per server the mean per-client decode rate (tokens after
  the first over the time from the first to the last) and completion tokens / wall.
- timeline (--timeline): the 4-client workload of bench_concurrent.py --quick (a ~300-word system
  prompt each, 2 turns of 16 tokens, a client's next turn sent when its reply is in), every request's
  start, first token and last token in seconds from the start, and tokens / wall: where a server's
  wall goes, request by request.
Every case runs `--rounds` times, the servers in alternating order (A B C, C B A, ...).

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_decode_servers.py [--rounds 2]
           [--clients 1,4] [--max-tokens 96] [--timeline] [--vllm-mlx /tmp/bench-venvs/vllm-mlx/bin/vllm-mlx]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from harness import ROOT
from harness.clients import stream_chat
from harness.prompts import QUESTIONS, system_prompt
from harness.reports import write_report
from harness.servers import Server, start_servers, stop_servers

TOPICS = ["the sea", "a mountain village", "an old clock", "a robot gardener", "winter in a city", "a lost cat"]
TOPICS += ["a library at night", "a train journey"]


def decode_case(server: Server, clients: int, max_tokens: int, tag: str) -> dict:
    replies: list = [None] * clients

    def client(i: int) -> None:
        msg = f"Write a long detailed story about {TOPICS[i % len(TOPICS)]} ({tag}, {i})."
        replies[i] = stream_chat(server, [{"role": "user", "content": msg}], max_tokens)

    wall = run_threads(client, clients)
    rates = [(r.completion_tokens - 1) / (r.done_s - r.ttft_s) for r in replies if r.done_s > r.ttft_s]
    return {
        "decode_tokens_per_s": statistics.mean(rates) if rates else 0.0,  # 0: every reply came in one piece
        "tokens_per_s": sum(r.completion_tokens for r in replies) / wall,
        "completion_tokens": [r.completion_tokens for r in replies],
    }


def timeline_case(server: Server, tag: str, clients: int = 4, turns: int = 2, max_tokens: int = 16) -> dict:
    requests: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def client(c: int) -> None:
        messages = [{"role": "system", "content": system_prompt(f"{tag}-{c}", 300)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"{QUESTIONS[(c + turn) % len(QUESTIONS)]} (client {c})"})
            sent = time.perf_counter() - start
            reply = stream_chat(server, messages, max_tokens, timeout_s=1800)
            messages.append({"role": "assistant", "content": reply.text})
            row = {"client": c, "turn": turn, "start": sent, "first": sent + reply.ttft_s, "last": sent + reply.done_s}
            with lock:
                requests.append(dict(row, tokens=reply.completion_tokens))

    wall = run_threads(client, clients)
    requests.sort(key=lambda r: (r["start"], r["client"]))
    return {"wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in requests) / wall, "requests": requests}


def run_threads(target, n: int) -> float:
    """Run target(i) for i < n on n threads at once; the wall seconds."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def report(result: dict, names: list[str]) -> list[str]:
    lines = ["# Decode speed, three servers", "", "| clients | server | decode tokens/s per client, rounds |"]
    lines[-1] += " tokens/s overall, rounds |"
    lines.append("|---|---|---|---|")
    for case, per_server in result["decode"].items():
        for name in names:
            rounds = per_server[name]
            rates = ", ".join(f"{r['decode_tokens_per_s']:.2f}" for r in rounds)
            overall = ", ".join(f"{r['tokens_per_s']:.2f}" for r in rounds)
            lines.append(f"| {case} | {name} | {rates} | {overall} |")
    for name, rounds in result.get("timeline", {}).items():
        for i, tl in enumerate(rounds):
            lines += [
                "",
                f"## Timeline, {name}, round {i + 1}: wall {tl['wall_s']:.2f} s, {tl['tokens_per_s']:.2f} tokens/s",
            ]
            lines += [
                "",
                "| client | turn | start s | first token s | last token s | tokens |",
                "|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {r['client']} | {r['turn'] + 1} | {r['start']:.2f} | {r['first']:.2f} | {r['last']:.2f} | {r['tokens']} |"
                for r in tl["requests"]
            ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeline", action="store_true", help="also the 4-client two-turn timeline")
    parser.add_argument("--model", help="model folder for every server (default: the default model)")
    parser.add_argument("--vllm-mlx", help="the vllm-mlx executable of a scratch venv (left out: not run)")
    parser.add_argument("--out", default=str(ROOT / "results" / "decode_servers"))
    args = parser.parse_args()
    servers = start_servers(Path(args.model) if args.model else None, args.vllm_mlx)
    names = [s.name for s in servers]
    result: dict = {"decode": {}, "max_tokens": args.max_tokens}
    try:
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for clients in (int(c) for c in args.clients.split(",")):
                case = result["decode"].setdefault(str(clients), {n: [] for n in names})
                for server in order:
                    case[server.name].append(decode_case(server, clients, args.max_tokens, f"r{r}"))
            if args.timeline:
                for server in order:
                    tag = f"tl{r}-{time.time()}"
                    result.setdefault("timeline", {}).setdefault(server.name, []).append(timeline_case(server, tag))
    finally:
        stop_servers(servers)
    write_report(result, Path(args.out), report(result, names))


if __name__ == "__main__":
    main()
