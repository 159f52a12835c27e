"""Many interleaved conversations: more of them than `mlx_lm.server` keeps prompt caches for (10).

`conversations` chats, each with its own short system prompt, advance round-robin: turn 1 of every
conversation, then turn 2 of every conversation, and so on. Each request goes to both servers in turn
(only one is busy at a time). With more conversations than its 10 cache entries, `mlx_lm.server`'s LRU
has dropped a conversation by the time it comes round again; our block cache keeps them all.
Reports mean TTFT (and mean cached tokens) per turn index for each server. With `--vllm-mlx`, vllm-mlx
too (its prefix cache on); with `--variants ssd-off`, our server with its SSD tier off beside the default
one (what the write-through costs the first visits: issue 26).
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_interleaved.py [--quick] [--out DIR]
           [--variants ssd-off] [--vllm-mlx /tmp/bench-venvs/vllm-mlx/bin/vllm-mlx]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import ROOT
from harness.reports import write_report
from harness.scenarios.interleaved import report_lines, scenario_interleaved
from harness.servers import start_servers, stop_servers
from harness.variants import VARIANTS, variant_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--out", default=str(ROOT / "results" / "interleaved"))
    parser.add_argument("--vllm-mlx", help="the vllm-mlx executable of a scratch venv (left out: not run)")
    parser.add_argument("--variants", default="", help=f"our server configured as these too: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    conversations = args.conversations or (12 if args.quick else 14)
    turns = args.turns or 3
    servers = start_servers(vllm_mlx=args.vllm_mlx)
    try:
        for i, name in enumerate(v for v in args.variants.split(",") if v):
            servers.insert(1 + i, variant_server(servers[0], name))
        result = scenario_interleaved(servers, conversations, turns, 4 if args.quick else 12)
    finally:
        stop_servers(servers)
    write_report(result, Path(args.out), report_lines(result, [s.name for s in servers]))


if __name__ == "__main__":
    main()
