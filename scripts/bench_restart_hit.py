"""The first request after a restart, in one process, next to its physical floor (issue 14).

SmolLM2-135M (float32) on a ~6k-token prompt: the cold time to first token, then, after each
restart of the engine on the same cache folder (RAM empty), the same prompt served from the SSD:
- read: every block read from the SSD ([ssd] compute_while_loading = false);
- split: the first blocks prefilled while the rest are read, split by the speeds the previous
  run measured (the default);
each with the block files in the page cache and dropped from it (posix_fadvise(DONTNEED)). The
floor is the prompt's KV bytes at the raw read bandwidth of the same files measured in the same
run, plus the RAM-hit time (the same prompt again, all blocks in RAM). A request of one token
measures the time to first token (prefill + one step). Engines run in-process: no HTTP.

Usage: .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_restart_hit.py
       [--words 4400] [--reps 2] [--quick] [--out results/restart_hit]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness import default_model_dir
from harness.diskio import CAN_DROP, block_files, drop_files, raw_read_s
from harness.prompts import system_prompt
from harness.reports import median, write_report
from harness.restart import make_engine, restart_report_lines, ttft


def run(words: int, reps: int, block_size: int, folder: Path) -> dict:
    from mlx_lm.utils import load

    from mlx_kvserve.models.loader import LoadedModel

    model_dir = default_model_dir()
    model, tokenizer = load(str(model_dir))
    loaded = LoadedModel("smollm2", model_dir, model, tokenizer, {}, 8192)
    prompt = tokenizer.encode(system_prompt(nonce=f"restart-{time.time()}", target_words=words))
    warm = tokenizer.encode(system_prompt(nonce="warm-up", target_words=40))  # kernels, not the prompt

    engine = make_engine(loaded, folder, block_size, split=True)
    ttft(engine, warm)
    cold, cached = ttft(engine, prompt)
    assert cached == 0
    engine.stop()  # drains the writer: every block is on disk; keeps the measured speeds
    files = block_files(folder)
    kv_bytes = sum(p.stat().st_size for p in files)
    modes = [("page_cache", False)] + ([("cold", True)] if CAN_DROP else [])
    times: dict[str, list[float]] = {}
    cached_by_kind: dict[str, int] = {}
    computed: dict[str, int] = {}
    for _ in range(reps):
        for mode, drop in modes:
            times.setdefault(f"raw_read_{mode}", []).append(raw_read_s(files, drop))
            for kind, split in (("read", False), ("split", True)):
                engine = make_engine(loaded, folder, block_size, split)
                ttft(engine, warm)
                if drop:
                    drop_files(files)
                elapsed, cached_by_kind[kind] = ttft(engine, prompt)
                computed[kind] = engine.local_cache_stats()["kv_split_computed_blocks"]
                times.setdefault(f"{kind}_{mode}", []).append(elapsed)
                times.setdefault("ram_hit", []).append(ttft(engine, prompt)[0])  # every block in RAM now
                engine.stop()
    out = {
        "prompt_tokens": len(prompt),
        "block_size": block_size,
        "kv_mib": kv_bytes / 2**20,
        "cold_s": cold,
        "cached_tokens": cached_by_kind,
        "split_computed_blocks": computed,
        "reps": reps,
    }
    out.update({name: median(ts) for name, ts in times.items()})
    out["ram_hit_s"] = out.pop("ram_hit")
    for mode, _ in modes:
        out[f"floor_{mode}"] = out[f"raw_read_{mode}"] + out["ram_hit_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, default=4400, help="system prompt words (4400: ~6k tokens)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a smoke run: ~600 tokens, one rep")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk for the cache folder")
    parser.add_argument("--out", type=Path, default=Path("results/restart_hit"))
    args = parser.parse_args(argv)
    words, reps = (440, 1) if args.quick else (args.words, args.reps)
    with tempfile.TemporaryDirectory(prefix="kvserve-restart-", dir=args.dir) as tmp:
        results = run(words, reps, args.block_size, Path(tmp) / "kv")
    write_report(results, args.out, restart_report_lines(results))
    return results


if __name__ == "__main__":
    main()
