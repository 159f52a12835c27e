"""TTFT side by side: mlx-kvserve vs mlx_lm.server on the same model, in one run.

Scenarios (chat, ~1.2k-token system prompt, greedy): cold, exact repeat, new question, and a
16-turn conversation (TTFT per turn). Both servers run with the same BLAS; requests alternate
between them and only one server is busy at a time. Also decode tokens/s of our engine vs plain
mlx-lm `stream_generate` on the same prompt, in-process.
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_prefix.py [--quick] [--out results/prefix]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import ROOT, default_model_dir
from harness.reports import write_report
from harness.scenarios.prefix import (
    decode_speed,
    report_lines,
    scenario_conversation,
    scenario_restart,
    scenario_system_prompt,
    ssd_write_cost,
)
from harness.servers import start_servers, stop_servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results" / "prefix"))
    parser.add_argument("--scenarios", default="system,restart,conversation,decode,ssd", help="comma-separated subset")
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument(
        "--system-words",
        default="880",
        help="system scenario prompt words, comma-separated for several sizes on the same servers (880: ~1.2k tokens)",
    )
    parser.add_argument("--reps", type=int, help="repeats of the system and restart scenarios (default 1 quick / 3)")
    args = parser.parse_args()
    wanted = set(args.scenarios.split(","))
    reps, turns = (1, 6) if args.quick else (3, 16)
    reps = args.reps or reps
    model_dir = Path(args.model) if args.model else default_model_dir()
    servers = start_servers(model_dir)
    try:
        results = {}
        sizes = [int(w) for w in args.system_words.split(",")]
        for words in sizes if "system" in wanted else []:  # several sizes: servers started once (a GPU run's time)
            key = "system_prompt" if len(sizes) == 1 else f"system_prompt_{words}w"
            results[key] = scenario_system_prompt(servers, reps, words)
        if "restart" in wanted:
            results["restart"] = scenario_restart(servers, reps)
        if "conversation" in wanted:
            results["conversation"] = scenario_conversation(servers, turns)
    finally:
        stop_servers(servers)
    if "decode" in wanted:
        results["decode"] = decode_speed(model_dir, reps, 64 if args.quick else 128)
    if "ssd" in wanted:
        results["ssd_write_cost"] = ssd_write_cost(model_dir, reps, 64 if args.quick else 128)
    lines = []
    for key in [k for k in results if k.startswith("system_prompt_")]:
        lines += [f"System prompt of {key.split('_')[-1][:-1]} words:", ""]
        lines += [*report_lines({"system_prompt": results[key]}), ""]
    write_report(results, Path(args.out), lines + report_lines(results))


if __name__ == "__main__":
    main()
