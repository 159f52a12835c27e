"""The cache-aware router (issue 15): seed 004's policies side by side on one replayed trace.

Three servers on loopback (RAM cache only, flushed before each policy) behind `mlx-kvserve router`. The trace:
`sessions` sessions x `turns` turns; most sessions share one of a few system prompts, the rest have their
own; sessions start as a Poisson process and each sends its next turn an exponential think time after its
reply (greedy replies, so the histories are the same under every policy). For each policy: mean and p90
TTFT, the cache hit rate (cached / prompt tokens, as the backends report them) and requests per backend.
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_router.py [--model M] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from harness import ROOT, default_model_dir
from harness.prompts import QUESTIONS, system_prompt
from harness.reports import write_report
from harness.servers import Server

POLICIES = ("round_robin", "load_only", "sticky", "lmetric", "unified")


class Turn(NamedTuple):
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    backend: str


def make_trace(
    sessions: int, shared_prompts: int, own_every: int, rate: float, seed: int, words: int
) -> list[tuple[float, str]]:
    """(start time, system prompt) per session: every `own_every`-th session has its own prompt."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(sessions):
        t += rng.expovariate(rate)
        nonce = f"own-{i}" if i % own_every == own_every - 1 else f"shared-{i % shared_prompts}"
        out.append((t, system_prompt(nonce, target_words=words)))
    return out


def stream_turn(url: str, session: int, messages: list[dict], max_tokens: int) -> tuple[float, str, dict, str]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start, first, text, usage = time.perf_counter(), None, [], {}
    headers = {"x-session-id": f"s{session}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as resp:
        resp.raise_for_status()
        backend = resp.headers.get("x-kvserve-backend", "?")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if piece := (choice.get("delta") or {}).get("content"):
                    first = first if first is not None else time.perf_counter() - start
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return (first if first is not None else time.perf_counter() - start), "".join(text), usage, backend


def run_session(url, i, start_at, system, turns, think_s, max_tokens, t0, rng_seed, out: list[Turn]) -> None:
    rng = random.Random(rng_seed)
    time.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    history = [{"role": "system", "content": system}]
    for k in range(turns):
        history.append({"role": "user", "content": f"{QUESTIONS[(i + k) % len(QUESTIONS)]} (session {i}, turn {k})"})
        ttft, text, usage, backend = stream_turn(url, i, history, max_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append(Turn(i, k, ttft, usage.get("prompt_tokens", 0), cached, backend))
        history.append({"role": "assistant", "content": text})
        time.sleep(rng.expovariate(1.0 / think_s))


def replay(url: str, trace, args) -> list[Turn]:
    out: list[Turn] = []
    t0 = time.perf_counter() + 0.5
    threads = [
        threading.Thread(target=run_session, args=(url, i, s, p, args.turns, args.think_s, args.max_tokens, t0, i, out))
        for i, (s, p) in enumerate(trace)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def summarize(turns: list[Turn], backends: list[str]) -> dict:
    ttfts = [t.ttft_s for t in turns]
    prompt, cached = sum(t.prompt_tokens for t in turns), sum(t.cached_tokens for t in turns)
    return {
        "requests": len(turns),
        "mean_ttft_s": statistics.fmean(ttfts),
        "p90_ttft_s": p90(ttfts),
        "hit_rate": cached / max(prompt, 1),
        "per_backend": [sum(1 for t in turns if t.backend == b) for b in backends],
    }


def start_router(backends: list[str], policy: str, port: int) -> Server:
    cmd = [sys.executable, "-m", "mlx_kvserve", "router", "--policy", policy, "--port", str(port)]
    for b in backends:
        cmd += ["--backend", b]
    router = Server(f"router-{policy}", cmd, port, dict(os.environ), "/health")
    router.wait("/health")
    deadline = time.time() + 120
    while True:
        body = httpx.get(router.url + "/health", timeout=5).json()
        if body["tokenizer"] == "loaded" and all(r["events"]["following"] for r in body["backends"]):
            return router
        if time.time() > deadline:
            raise TimeoutError(f"router not ready: {body}")
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model of the three servers (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=1.0, help="sessions started per second (Poisson)")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean think time between a reply and the next turn")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--system-words", type=int, default=300, help="system prompt length (~1.5 tokens a word)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--quick", action="store_true", help="6 sessions x 2 turns")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "router")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns = 6, 2
    model = args.model or str(default_model_dir())
    trace = make_trace(args.sessions, 3, 4, args.rate, seed=4, words=args.system_words)
    home = Path(tempfile.mkdtemp(prefix="bench-router-"))
    config = home / "backend.toml"
    config.write_text("[ssd]\nenabled = false\n")
    servers = []
    try:
        for i in range(3):
            port = 8710 + i
            env = dict(os.environ, MLX_KVSERVE_HOME=str(home / f"b{i}"))
            cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", model, "--port", str(port)]
            servers.append(Server(f"backend{i}", [*cmd, "--config", str(config)], port, env, "/health"))
        for s in servers:
            s.wait("/health")
        urls = [s.url for s in servers]
        results, rows = {}, []
        for policy in args.policies.split(","):
            for s in servers:
                httpx.post(s.url + "/v1/cache/flush", json={}, timeout=60).raise_for_status()
            router = start_router(urls, policy, 8700)
            try:
                turns = replay(router.url, trace, args)
            finally:
                router.stop()
            results[policy] = summarize(turns, urls)
            r = results[policy]
            rows.append(
                f"| {policy} | {r['mean_ttft_s'] * 1000:.0f} | {r['p90_ttft_s'] * 1000:.0f} | {r['hit_rate']:.1%} | "
                f"{' / '.join(map(str, r['per_backend']))} |"
            )
            print(rows[-1], flush=True)
    finally:
        for s in servers:
            s.stop()
    lines = [
        f"# Router policies: {args.sessions} sessions x {args.turns} turns, 3 backends ({Path(model).name})",
        "",
        "| policy | mean TTFT ms | p90 TTFT ms | cache hit rate | requests per backend |",
        "|---|---|---|---|---|",
        *rows,
    ]
    lines += ["", *targets(results)]
    write_report({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, args.out, lines)
    chart(results, args.out / "router.png")


def chart(results: dict, out: Path) -> None:
    """Mean and p90 TTFT and the hit rate per policy, side by side (one PNG; needs the bench extra)."""
    try:
        import matplotlib
    except ImportError:
        print("no chart: matplotlib is missing (pip install -e '.[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = range(len(policies))
    left.bar([i - 0.2 for i in x], [results[p]["mean_ttft_s"] * 1000 for p in policies], 0.4, label="mean")
    left.bar([i + 0.2 for i in x], [results[p]["p90_ttft_s"] * 1000 for p in policies], 0.4, label="p90")
    left.set_xticks(list(x), policies, rotation=20)
    left.set_ylabel("TTFT (ms)")
    left.legend()
    right.bar(list(x), [results[p]["hit_rate"] * 100 for p in policies], 0.6, color="tab:green")
    right.set_xticks(list(x), policies, rotation=20)
    right.set_ylabel("cache hit rate (%)")
    fig.suptitle("Router policies, one replayed trace (3 backends)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def targets(results: dict) -> list[str]:
    """Issue 15's targets, each with its verdict."""
    need = {"sticky", "load_only", "round_robin"}
    if not need <= set(results):
        return []
    out = []
    for p in ("lmetric", "unified"):
        if p not in results:
            continue
        r = results[p]
        hit = r["hit_rate"] >= 0.9 * results["sticky"]["hit_rate"]
        tail = r["p90_ttft_s"] <= results["load_only"]["p90_ttft_s"]
        mean = r["mean_ttft_s"] < results["round_robin"]["mean_ttft_s"]
        out.append(
            f"- {p}: hit rate >= 90% of sticky's: {'yes' if hit else 'no'}; p90 TTFT <= load_only's: "
            f"{'yes' if tail else 'no'}; mean TTFT < round_robin's: {'yes' if mean else 'no'}"
        )
    return out


if __name__ == "__main__":
    main()
