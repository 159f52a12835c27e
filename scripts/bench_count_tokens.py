"""Token counts beside a chat (issue 46, finding 6): `--counts` concurrent /v1/messages/count_tokens of
`--body-mb` MB each, and a small chat's latency while they run, on our server with the default model.

Variants, alternated `--rounds` times, each on a fresh server:
  unbounded  [server] max_concurrent_counts = max_queue + 1 (what the server did before: counts were held
             only by the in-flight limit)
  bounded    the default (2)
Per run: the server's peak RSS during the counts (sampled from /proc every 50 ms), the counts' statuses,
the small chat's median latency before (idle) and of the chats sent one after another while the counts
run (`busy`: the first of them waits the longest). Linux only (/proc).
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_count_tokens.py [--counts 12 --body-mb 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from harness import OURS, default_model_dir
from harness.servers import Server, free_port, server_env, toml_text

VARIANTS = {"unbounded": 17, "bounded": 2}  # max_concurrent_counts; 17 = the default in-flight limit
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def chat_s(url: str) -> float:
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start


def count_body(i: int, body_mb: float) -> dict:
    words, size, n = [], 0, 0
    while size < body_mb * 1_000_000:
        word = f"w{(i * 7919 + n) % 10007} "
        words.append(word)
        size, n = size + len(word), n + 1
    return {"model": "default", "messages": [{"role": "user", "content": "".join(words)}]}


def run(variant: str, counts: int, body_mb: float, model_dir: Path) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-count-"))
    (home / "config.toml").write_text(toml_text({"server": {"max_concurrent_counts": VARIANTS[variant]}}))
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model_dir), "--port", str(port)]
    server = Server(
        OURS,
        cmd + ["--config", str(home / "config.toml")],
        port,
        server_env() | {"MLX_KVSERVE_HOME": str(home)},
        "/health",
    )
    try:
        server.wait("/health", timeout=600)
        chat_s(server.url)  # warm-up
        idle = [chat_s(server.url) for _ in range(5)]
        base_rss = rss_mb(server.proc.pid)
        bodies = [count_body(i, body_mb) for i in range(counts)]
        statuses: list[int] = []
        done = threading.Event()
        peak = [base_rss]

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(server.proc.pid))
                time.sleep(0.05)

        def count(body: dict) -> None:
            statuses.append(httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=900).status_code)

        threads = [threading.Thread(target=count, args=(b,)) for b in bodies]
        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(1.0)  # the bodies are uploaded and the counts started
        busy = []  # chats sent while counts still ran, back to back
        while any(t.is_alive() for t in threads) or not busy:
            busy.append(chat_s(server.url))
        for t in threads:
            t.join()
        counts_s = time.perf_counter() - start
        done.set()
        sampler.join()
        return {
            "variant": variant,
            "idle_chat_s": statistics.median(idle),
            "busy_chat_s": statistics.median(busy),
            "busy_chat_max_s": max(busy),
            "num_busy_chats": len(busy),
            "base_rss_mb": base_rss,
            "peak_rss_mb": peak[0],
            "statuses": dict(Counter(statuses)),
            "counts_s": counts_s,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, default=12)
    parser.add_argument("--body-mb", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model_dir = default_model_dir()
    results = [run(v, args.counts, args.body_mb, model_dir) for _ in range(args.rounds) for v in VARIANTS]
    print(f"{args.counts} concurrent count_tokens of {args.body_mb:g} MB; a small chat (8 tokens) beside them")
    print("variant    idle chat  busy chat (median, max, n)   slowdown  RSS base -> peak   statuses       counts took")
    for r in results:
        print(
            f"{r['variant']:<10} {r['idle_chat_s']:8.3f}s  {r['busy_chat_s']:8.3f}s {r['busy_chat_max_s']:8.3f}s "
            f"{r['num_busy_chats']:3d}   {r['busy_chat_s'] / r['idle_chat_s']:7.1f}x  "
            f"{r['base_rss_mb']:6.0f} -> {r['peak_rss_mb']:6.0f} MB  {r['statuses']!s:<14} {r['counts_s']:6.1f}s"
        )


if __name__ == "__main__":
    main()
