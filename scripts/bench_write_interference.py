"""SSD writes next to a cold prefill, in one process (issue 14, item 4).

A long request leaves its blocks in the SSD writer's queue; the next request's cold prefill then
runs while the writer writes them. Measured with SmolLM2-135M (float32), per repetition:
- busy: request A (a long unique prompt) runs, then at once request B (a unique prompt) is timed
  to its first token while A's blocks are written;
- idle: the writer is waited for, then request C (a unique prompt of B's length) is timed.
The slowdown is busy / idle, for `[ssd] write_hold_s` 0 (the writer never waits) and the default
(background writes wait while a request prefills, up to that many seconds). Also the writer's own
bandwidth (the batches it wrote) next to a raw sequential write + fsync of as many bytes in the
same folder, measured in the same run. Targets: slowdown at most 10%, writer at least 0.7x raw.

Usage: .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_write_interference.py
       [--long-words 4400] [--words 1500] [--reps 3] [--quick] [--out results/write_interference]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness import default_model_dir
from harness.diskio import raw_write_bps
from harness.prompts import system_prompt
from harness.reports import median, write_report
from harness.restart import interference_report_lines, make_engine, ttft


def run(long_words: int, words: int, reps: int, folder: Path, holds: list[float]) -> dict:
    from mlx_lm.utils import load

    from mlx_kvserve.models.loader import LoadedModel

    model_dir = default_model_dir()
    model, tokenizer = load(str(model_dir))
    loaded = LoadedModel("smollm2", model_dir, model, tokenizer, {}, 8192)
    out: dict = {"reps": reps, "holds": {}}
    for hold in holds:
        engine = make_engine(loaded, folder / f"hold{hold}", 64, split=True)
        tier = engine.prefix_cache.ssd_tier
        tier.write_hold_s = hold
        ttft(engine, tokenizer.encode(system_prompt(nonce="warm-up", target_words=40)))
        tier.writer.wait_idle(120)
        busy, idle, queued = [], [], []

        def unique(kind: str, n: int, rep: int, hold: float = hold) -> list[int]:
            return tokenizer.encode(system_prompt(nonce=f"{kind}-{rep}-{hold}-{time.time()}", target_words=n))

        for rep in range(reps):
            ttft(engine, unique("long", long_words, rep))
            queued.append(tier.writer.drain_estimate().nbytes)
            busy.append(ttft(engine, unique("busy", words, rep))[0])
            tier.writer.wait_idle(300)
            idle.append(ttft(engine, unique("idle", words, rep))[0])
            tier.writer.wait_idle(300)
        written = tier.writer.bandwidth.bytes_per_s() or 0.0
        raw = raw_write_bps(folder, max(64 << 20, int(median(queued))))
        engine.stop()
        out["holds"][str(hold)] = {
            "busy_s": median(busy),
            "idle_s": median(idle),
            "slowdown": median(busy) / median(idle),
            "queued_mib": median(queued) / 2**20,
            "writer_mib_s": written / 2**20,
            "raw_write_mib_s": raw / 2**20,
            "writer_vs_raw": written / raw,
        }
        print(hold, out["holds"][str(hold)], flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-words", type=int, default=4400, help="words of request A (~6k tokens)")
    parser.add_argument("--words", type=int, default=1500, help="words of requests B and C (~2k tokens)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--holds", default="0,2.0", help="write_hold_s values to compare")
    parser.add_argument("--quick", action="store_true", help="a smoke run: short prompts, one rep")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk for the cache folder")
    parser.add_argument("--out", type=Path, default=Path("results/write_interference"))
    args = parser.parse_args(argv)
    long_words, words, reps = (400, 150, 1) if args.quick else (args.long_words, args.words, args.reps)
    holds = [float(h) for h in args.holds.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvserve-writes-", dir=args.dir) as tmp:
        results = run(long_words, words, reps, Path(tmp), holds)
    write_report(results, args.out, interference_report_lines(results))
    return results


if __name__ == "__main__":
    main()
