"""Concurrent clients: continuous batching against `mlx_lm.server` (its batching on, as by default) and,
with `--vllm-mlx`, vllm-mlx (continuous batching and its prefix cache on, a fresh HOME).

For C in `clients` (default 1, 4, 8; 16 too with --clients 4,8,16): C clients at once, each with its own
system prompt (~`system_words` words) and its growing history, T turns each (a client sends its next
turn when its reply is in). Then `shared`: 8 clients arriving at once with one shared (cold) system
prompt and their own question. All servers are started first and measured one at a time. Reports mean
and p90 TTFT per turn, the cold first turns' mean / p99 / max next to the later turns' mean, overall
completion tokens/s, and issue 26's targets as ratios ours / mlx_lm.server and ours / vllm-mlx.
With --rounds R (R > 1), each case runs R rounds, the servers in alternating order (A B C, C B A, ...),
each round on new system prompts: a load change on a shared machine then falls on every server, and the
report gives each round's figures, the ratios per round with their median and range, and the targets
on the median ratios (harness/scenarios/concurrent_rounds.py).
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_concurrent.py [--quick] [--out DIR]
           [--clients 4,8,16] [--rounds 3] [--variants fifo] [--vllm-mlx /tmp/bench-venvs/vllm-mlx/bin/vllm-mlx]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import ROOT
from harness.reports import write_report
from harness.scenarios.concurrent import report_lines, scenario_concurrent
from harness.scenarios.concurrent_rounds import rounds_report_lines, scenario_rounds
from harness.servers import start_servers, stop_servers
from harness.synthetic import synthetic_model
from harness.variants import VARIANTS, variant_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter prompts and replies, 2 turns")
    parser.add_argument("--out", default=str(ROOT / "results" / "concurrent"))
    parser.add_argument("--clients", help="comma-separated client counts (default 1,4,8)")
    parser.add_argument("--words", type=int, help="system prompt words (default 300 quick / 1400)")
    parser.add_argument("--turns", type=int, help="turns per client (default 2 quick / 3)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per case, servers alternating (default 1)")
    parser.add_argument("--ssd-off-too", action="store_true", help="also run our server with [ssd] enabled = false")
    parser.add_argument(
        "--variants",
        default="",
        help=f"also run our server configured as these, comma-separated: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--model", help="model folder for every server (default: the default model)")
    parser.add_argument("--vllm-mlx", help="the vllm-mlx executable of a scratch venv (left out: not run)")
    parser.add_argument("--synthetic", help="a random-weight llama of this shape instead, e.g. llama3-8b (GPU runs)")
    parser.add_argument("--bits", type=int, default=4, help="weight bits of --synthetic (0: float16)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    turns, max_tokens, words = (2, 16, 300) if args.quick else (3, 32, 1400)
    turns, words = args.turns or turns, args.words or words
    clients = [int(c) for c in args.clients.split(",")] if args.clients else [1, 4, 8]
    model_dir = Path(args.model) if args.model else None
    if args.synthetic:
        model_dir = synthetic_model(args.synthetic, args.bits, Path(tempfile.mkdtemp(prefix="kvserve-model-")) / "m")
    servers = start_servers(model_dir, args.vllm_mlx)
    names = (["ssd-off"] if args.ssd_off_too else []) + [v for v in args.variants.split(",") if v]
    for i, name in enumerate(names):
        servers.insert(1 + i, variant_server(servers[0], name))
    try:
        if args.rounds > 1:
            result = scenario_rounds(servers, clients, turns, max_tokens, words, args.rounds)
        else:
            result = scenario_concurrent(servers, clients, turns, max_tokens, words)
    finally:
        stop_servers(servers)
    result["commands"] = {s.name: " ".join(s.cmd) for s in servers}
    lines = (rounds_report_lines if args.rounds > 1 else report_lines)(result, [s.name for s in servers])
    write_report(result, Path(args.out), lines)


if __name__ == "__main__":
    main()
