"""Seed 001's flood experiment, scaled to this machine: does a pinned conversation survive?

A conversation (system prompt + `depth` turns) is warmed; in the pinned variant it is pinned;
then a flood of other conversations, several times larger than the RAM and SSD budgets, goes
through; then the conversation's next turn is sent and its TTFT and cached tokens (from the same
streamed request, `stream_options.include_usage`) are recorded. Variants: mlx-kvserve pinned,
mlx-kvserve unpinned, mlx_lm.server (no pins, 10-entry cache) — same model, one run.
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_pins.py [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import ROOT, default_model_dir
from harness.reports import write_report
from harness.scenarios.pins import report_lines, run_pins
from harness.servers import server_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results" / "pins"))
    args = parser.parse_args()
    depths = [0, 16] if args.quick else [0, 4, 8, 16]
    rules, flood_n = (12, 12) if args.quick else (16, 12)
    results = run_pins(default_model_dir(), server_env(), depths, rules, flood_n)
    write_report(results, Path(args.out), report_lines(results))


if __name__ == "__main__":
    main()
