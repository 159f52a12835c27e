"""A restore after a restart with a realistic KV, next to its floor, in one run (issue 44 item 3).

The model is the harness's `kv-heavy` llama (float32, 32 layers x 4 KV heads x 128 dims: 128 KiB of KV
per token, Llama-3-8B's in float16, with little compute). For each prompt length: the prompt's blocks
are made once and written to a cache folder on the disk (`--dir`), then, `--reps` times:
- raw read: the same files read with plain sequential reads, from a cold page cache
  (posix_fadvise(DONTNEED) per file);
- restore: a new engine on the folder (RAM empty), the files dropped from the page cache, the prompt
  sent (every stored block read: [ssd] compute_while_loading = false), mlx's buffer cache emptied
  first as in a new process; its time to the first token, and the part spent in the SSD tier's reads
  (read, checksum, arrays);
- RAM hit: the same prompt again on that engine (every block in RAM);
- with --before, the restore as before the direct read (the chain read into RAM's own run, then the
  request's cache assembled from it: a second copy of the prefix), alternated.
floor = raw read + RAM hit; the target is restore <= 1.3x floor, the reads >= 80% of the raw speed.
A cold prefill at this length takes this CPU minutes to hours, so the blocks are made with attention
skipped (the output of that pass is not used); `--cold` times one real cold prefill for scale.
Engines run in-process: no HTTP. The folder is deleted at the end.

Usage: .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_engine.py restore
       [--tokens 4352,16384] [--reps 3] [--before] [--cold] [--dir /tmp] [--out results/restore_big]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import mlx.core as mx

from harness.diskio import CAN_DROP, block_files, drop_files, raw_read_s
from harness.reports import median, write_report
from harness.restart import ttft
from harness.synthetic import llama_config, random_llama, write_model_folder

SHAPE = "kv-heavy"
GIB = 1024**3


@contextmanager
def attention_skipped():
    """Attention returns its queries (the same shape): a prompt's KV is made in seconds, not hours."""
    real = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = lambda q, k, v, **kwargs: q
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = real


def load_model(folder: Path, max_tokens: int):
    from mlx_kvserve.models.loader import LoadedModel

    config = llama_config(SHAPE, max_position_embeddings=max(max_tokens + 64, 16384))
    write_model_folder(folder, config)  # the tokenizer and config; the weights stay in memory
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model = random_llama(config, dtype=mx.float32)
    return LoadedModel("kv-heavy", folder, model, load_tokenizer(folder), config, config["max_position_embeddings"])


def make_engine(loaded, folder: Path):
    """An engine on `folder` that reads every stored block ([ssd] compute_while_loading = false) and
    whose shutdown waits for every queued write (the folder must hold the whole prompt)."""
    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine

    ssd = {"cache_dir": str(folder), "compute_while_loading": False, "write_hold_s": 0.0, "drain_timeout_s": 3600.0}
    return Engine(loaded, load_config(overrides={"ssd": ssd}))


def prompt_of(length: int, nonce: int) -> list[int]:
    return [3 + (i * 7919 + nonce * 104729) % 250 for i in range(length)]


def run_length(loaded, tokens: int, reps: int, folder: Path, cold: bool, before: bool, warm: list[int]) -> dict:
    prompt = prompt_of(tokens, tokens)
    engine = make_engine(loaded, folder)
    with attention_skipped():
        ttft(engine, prompt)
    engine.stop()  # drains the writer: every block is on disk
    files = block_files(folder)
    if len(files) < tokens // 64:
        raise RuntimeError(f"{len(files)} block files for {tokens} tokens: the writer did not write them all")
    kv_bytes = sum(p.stat().st_size for p in files)
    times: dict[str, list[float]] = {}
    cached = 0
    variants = ["", "before_"] if before else [""]
    for rep in range(reps):
        times.setdefault("raw_read_cold", []).append(raw_read_s(files, cold=CAN_DROP))
        for variant in variants if rep % 2 == 0 else variants[::-1]:
            engine = make_engine(loaded, folder)
            ttft(engine, warm)
            mx.clear_cache()  # as after a restart: the allocator holds no freed buffers of the last engine
            reads = timed_reads(engine)
            drop_files(files) if CAN_DROP else None
            with previous_reads() if variant else nullcontext():
                elapsed, cached = ttft(engine, prompt)
            if cached < tokens - 64:
                raise RuntimeError(f"{cached} of {tokens} tokens restored: a restore cannot be timed")
            times.setdefault(f"{variant}restore", []).append(elapsed)
            times.setdefault(f"{variant}tier_reads", []).append(sum(reads))
            times.setdefault("ram_hit", []).append(ttft(engine, prompt)[0])
            engine.stop()
    out = {"tokens": tokens, "kv_bytes": kv_bytes, "files": len(files), "cached_tokens": cached, "reps": reps}
    out.update({name: median(ts) for name, ts in times.items()})
    out["floor"] = out["raw_read_cold"] + out["ram_hit"]
    out["raw_gib_s"] = kv_bytes / GIB / out["raw_read_cold"]
    out["reads_gib_s"] = kv_bytes / GIB / out["tier_reads"]
    print(report_lines([out])[-1], flush=True)
    if cold:
        engine = make_engine(loaded, folder.with_name("cold-kv"))
        ttft(engine, warm)
        out["cold_prefill"] = ttft(engine, prompt_of(tokens, tokens + 1))[0]
        engine.stop()
        shutil.rmtree(folder.with_name("cold-kv"), ignore_errors=True)
    return out


@contextmanager
def previous_reads():
    """The restore as it was before the direct read: the chain read into RAM's own run, promoted,
    then the request's cache assembled from it (a second copy of the prefix)."""
    from mlx_kvserve.kv.blocks import CacheLayout

    real = CacheLayout.direct_positions
    CacheLayout.direct_positions = lambda self, prompt_len: None
    try:
        yield
    finally:
        CacheLayout.direct_positions = real


def timed_reads(engine) -> list[float]:
    """The seconds each of the engine's SSD tier reads takes from now on (load_many), appended."""
    tier = _find_tier(engine)
    seconds: list[float] = []
    load_many = tier.load_many

    def timed(wanted, into=None):
        start = time.perf_counter()
        try:
            return load_many(wanted, into)
        finally:
            seconds.append(time.perf_counter() - start)

    tier.load_many = timed
    return seconds


def _find_tier(engine):
    from mlx_kvserve.kv.ssd.tier import SSDTier

    seen, todo = set(), [engine]
    while todo:  # the tier sits a few attributes below the engine; found by type, not by path
        obj = todo.pop()
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        for value in vars(obj).values():
            if isinstance(value, SSDTier):
                return value
            if type(value).__module__.startswith("mlx_kvserve"):
                todo.append(value)
    raise RuntimeError("the engine has no SSD tier")


def report_lines(results: list[dict]) -> list[str]:
    lines = [
        f"# A restore after a restart, {SHAPE} (128 KiB of KV per token), files cold, median of {results[0]['reps']}",
        "",
        "| tokens | KV GiB | files | raw read cold s (GiB/s) | RAM hit s | floor s | restore s | restore / floor | "
        "tier reads s (GiB/s, / raw) | before: restore s, / floor, tier reads s | cold prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cold = f"{r['cold_prefill']:.1f}" if "cold_prefill" in r else "-"
        before = "-"
        if "before_restore" in r:
            before = f"{r['before_restore']:.3f}, {r['before_restore'] / r['floor']:.2f}x, {r['before_tier_reads']:.3f}"
        lines.append(
            f"| {r['tokens']} | {r['kv_bytes'] / GIB:.2f} | {r['files']} | {r['raw_read_cold']:.3f} "
            f"({r['raw_gib_s']:.2f}) | {r['ram_hit']:.3f} | {r['floor']:.3f} | {r['restore']:.3f} | "
            f"{r['restore'] / r['floor']:.2f}x | {r['tier_reads']:.3f} ({r['reads_gib_s']:.2f}, "
            f"{r['reads_gib_s'] / r['raw_gib_s']:.0%}) | {before} | {cold} |"
        )
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="4352,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also time a real cold prefill (slow on a CPU)")
    parser.add_argument("--before", action="store_true", help="also the restore before the direct read, alternated")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk for the cache folder")
    parser.add_argument("--out", type=Path, default=Path("results/restore_big"))


def run(args: argparse.Namespace) -> list[dict]:
    lengths = [int(t) for t in args.tokens.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvserve-restore-", dir=args.dir) as tmp:
        loaded = load_model(Path(tmp) / "model", max(lengths))
        warm = prompt_of(40, 0)
        for tokens in lengths:
            folder = Path(tmp) / f"kv-{tokens}"
            results.append(run_length(loaded, tokens, args.reps, folder, args.cold, args.before, warm))
            shutil.rmtree(folder)  # the disk and the page cache back before the next length
    write_report({"results": results}, args.out, report_lines(results))
    return results
