"""Long prompts at a real model shape: cold vs RAM hit vs SSD hit after a restart, in-process.

Built for the lent GPU machine (../shared/DEVICE.md): a Llama-3-8B-shaped model with random 4-bit
weights is built in memory (no download) and prompts of 2k, 8k and 16k tokens go through the
product's own Engine (worker thread, block cache, SSD tier and its writer). For each length:

- cold: a prompt no tier holds (prefill of every token);
- RAM hit: the same long prefix with a new question (the prefix from RAM, the question prefilled);
- SSD hit: after a restart (the engine stopped, its writer drained, a new engine on the same
  cache folder with an empty RAM tier), the prefix with a third question: once with every block
  read from the SSD (`ssd.compute_while_loading` off), once with the first blocks prefilled while
  the rest are read (on: split by the speeds the previous engine measured and kept; a warm-up
  restart measures them first);
- floor: the prefix's KV bytes at the raw read bandwidth of the cache folder's files (plain
  sequential reads, measured right after) plus the RAM-hit time (issue 14's target: within 1.5x);
- plain mlx-lm: `stream_generate` on the cold prompt, the reference the cold run should match.

Issue 44's figures, in the same run: the exact repeat (the same prompt again); the restore after a
restart with the block files dropped from the page cache (the product's defaults), next to its floor:
the prefix's bytes at the raw read speed of the same files from a cold page cache, plus the RAM hit;
the arrays a hit joins per layer (kv/concat.join_pair's inputs: a few at any length is the goal, one
per block is what a restore's blocks read back one by one cost); and mlx-lm's own one-cache path, as
`mlx_lm.server` serves one conversation in process (one prompt cache kept, trimmed to the prefix the
next prompt shares, the rest prefilled): its cold prompt (plain mlx-lm's cold prefill), exact repeat
and new question. Our side and theirs alternate their order from rep to rep.

TTFT is the engine's first-token time (lookup, SSD reads, assembly, prefill, first sample) and
excludes HTTP. The model stays loaded across the restart, as model loading is not part of any
TTFT; the SSD files may still be in the OS page cache, as after a server restart (not a reboot).
Each length is warmed up once with a throwaway prefix first (MLX compiles kernels per shape).

Usage:
  GPU:  python3 scripts/bench_engine.py lengths --out results/gpu
  issue 44 (8k / 16k / 32k): python3 scripts/bench_engine.py lengths --lengths 8192,16384,32768 --out results/gpu
  CPU smoke run (any machine): python scripts/bench_engine.py lengths --shape tiny --lengths 256,512 --out /tmp/gpu
  long contexts on a CPU (issue 44 item 4, docs/benchmarks.md "Long contexts"): a compute-free attention,
  16 KiB of float32 KV per token (kv-heavy's heads, 4 layers), a RAM tier that holds a 128k prefix:
    python scripts/bench_engine.py lengths --shape kv-heavy --layers 4 --bits 0 --dtype float32 --compute-free \
      --lengths 32768,65536,131072 --reps 1 --warmup-tokens 4096 --prefill-step 4096 --ram-max-bytes 5GiB
  With --compute-free each rep also times one memory copy of the prefix (a hit's floor) and the process's
  peak RSS during the exact repeat against its RSS before it (at most one copy of the prefix more).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from harness.diskio import CAN_DROP, block_files, drop_files, raw_read_s, read_file
from harness.hits import JoinCounter, OneCache
from harness.long_context import LONG_MEDIANS, copy_floor, long_lines, make_compute_free, peak_rss_during
from harness.reports import machine, median, write_report
from harness.restart import served_ttft
from harness.synthetic import kv_bytes_per_token

QUESTION_TOKENS = 32
MEDIANS = ("cold_s", "ram_hit_s", "ssd_hit_s", "ssd_split_s", "floor_s", "raw_read_gib_s", "mlx_lm_cold_s")
ISSUE44_MEDIANS = tuple(
    "repeat_s restore_s restore_floor_s raw_cold_read_gib_s mlx_lm_repeat_s mlx_lm_new_question_s repeat_over_mlx_lm "
    "new_question_over_mlx_lm restore_over_floor restore_over_mlx_lm_cold".split()
)
KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama3-8b", help="llama3-8b | tiny (harness/synthetic.py SHAPES)")
    parser.add_argument("--bits", type=int, default=4, help="weight bits (0: unquantized)")
    parser.add_argument("--dtype", default="float16", help="activation and KV dtype: float16 | bfloat16 | float32")
    parser.add_argument("--lengths", default="2048,8192,16384", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=0, help="0: the product's default")
    parser.add_argument("--work-dir", default="", help="model folder and SSD cache (default: a temp folder, removed)")
    parser.add_argument("--out", default="results/gpu")
    parser.add_argument("--layers", type=int, default=0, help="0: the shape's")
    parser.add_argument("--compute-free", action="store_true", help="attention without scores (harness/long_context)")
    ram_help = "the RAM tier budget, e.g. 5GiB (default: the plan's; 1GiB on a small shape)"
    parser.add_argument("--ram-max-bytes", default="", help=ram_help)
    parser.add_argument("--prefill-step", type=int, default=0, help="[generation] prefill_step_size (0: by device)")
    parser.add_argument("--warmup-tokens", type=int, default=0, help="the throwaway warm-up prefix (0: each length)")


class Bench:
    """An Engine over one loaded model, restartable on the same SSD folder."""

    def __init__(self, loaded, work: Path, args: argparse.Namespace):
        from mlx_kvserve.config import load_config

        # A real shape's RAM tier is the memory plan's (engine/memory/plan.py): an explicit 64 GiB left an
        # 80 GB GPU room for a 12k-token context only, refusing the 16k and 32k prompts.
        cache = {} if loaded.config["hidden_size"] >= 1024 else {"ram_max_bytes": args.ram_max_bytes or "1GiB"}
        if args.block_size:
            cache["block_size"] = args.block_size
        overrides = {"cache": cache, "ssd": {"cache_dir": str(work / "kv")}}
        if args.prefill_step:  # long prompts: mlx-lm's batch cache grows by a copy of itself each step
            overrides["generation"] = {"prefill_step_size": args.prefill_step}
        self.config = load_config(overrides=overrides)
        self.kv_dir = work / "kv"
        self.kv_dtype_bytes = KV_DTYPE_BYTES[args.dtype]
        self.compute_free = args.compute_free
        self.loaded = loaded
        self.engine = None

    def start(self, split: bool = True) -> None:
        from mlx_kvserve.engine.engine import Engine

        ssd = dataclasses.replace(self.config.ssd, compute_while_loading=split)
        self.engine = Engine(self.loaded, dataclasses.replace(self.config, ssd=ssd))
        self.engine.start()
        planned = self.engine.memory_plan.max_context
        if planned < self.loaded.context_length:
            raise SystemExit(
                f"the memory plan allows {planned} tokens of context, not the model's "
                f"{self.loaded.context_length}: {self.engine.memory_plan.line()}"
            )

    def restart(self, split: bool = True) -> None:
        import mlx.core as mx

        self.stop()
        gc.collect()
        mx.clear_cache()
        self.start(split)

    def split_blocks(self) -> int:
        return self.engine.local_cache_stats().get("kv_split_computed_blocks", 0)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def ttft(self, tokens: list[int]) -> tuple[float, int]:
        """(engine TTFT seconds, cached tokens) of a one-token greedy request."""
        return served_ttft(self.engine, tokens)


def build_model(args: argparse.Namespace, folder: Path):
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from harness.synthetic import llama_config, random_llama, write_model_folder
    from mlx_kvserve.models.loader import LoadedModel, context_length

    overrides = {"quantization": {"group_size": 64, "bits": args.bits}} if args.bits else {}
    longest = max(int(n) for n in args.lengths.split(","))
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.compute_free:
        make_compute_free()
    config = llama_config(args.shape, **overrides)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], longest + 2 * QUESTION_TOKENS)
    start = time.perf_counter()
    model = random_llama(config, dtype=getattr(mx, args.dtype))
    write_model_folder(folder, config)  # config and tokenizer: what the cache's model fingerprint reads
    print(f"model {args.shape} built in {time.perf_counter() - start:.1f}s", flush=True)
    tokenizer = load_tokenizer(folder)
    return LoadedModel(f"random-{args.shape}", folder, model, tokenizer, config, context_length(config))


def raw_read_bps(folder: Path) -> float:
    """Bytes per second of plain sequential reads of every block file under `folder` (as they are: the
    restart hits just read them, so mostly from the page cache, like the hits themselves)."""
    files = [p for p in block_files(folder) if not p.name.startswith(".")]  # not a save in progress
    buf, total, start = memoryview(bytearray(8 << 20)), 0, time.perf_counter()
    for path in files:
        with contextlib.suppress(FileNotFoundError):  # evicted or replaced since the listing
            total += read_file(path, buf)
    elapsed = time.perf_counter() - start
    return total / elapsed if elapsed > 0 and total else 0.0


def ours(bench: Bench, joins: JoinCounter, prefix: list[int], questions: list[list[int]], prefix_bytes: int) -> dict:
    """The engine's side of one rep: cold, exact repeat, new question (RAM), the SSD hits after restarts
    (page cache warm: read, split), the restore from a cold page cache and its floor."""
    first = prefix + questions[0]
    cold, cold_cached = bench.ttft(first)
    ((repeat, repeat_cached), repeat_joins), rss_before, rss_peak = peak_rss_during(
        lambda: joins.per_layer(lambda: bench.ttft(first))
    )
    ram_bytes = bench.engine.local_cache_stats().get("kv_ram_bytes", 0)
    ram, ram_cached = bench.ttft(prefix + questions[1])
    bench.restart(split=False)
    ssd, ssd_cached = bench.ttft(prefix + questions[2])
    bench.restart(split=True)
    split, split_cached = bench.ttft(prefix + questions[3])
    computed = bench.split_blocks()
    raw = raw_read_bps(bench.kv_dir)
    bench.restart()  # the product's defaults; the files dropped from the page cache as after a reboot
    files = block_files(bench.kv_dir)  # read while the engine is idle: the restore writes tails of its own
    sample = newest_files(files, prefix_bytes)  # the prefix's bytes, not every rep's (12 GiB at 32k)
    raw_cold = sum(p.stat().st_size for p in sample) / raw_read_s(sample, cold=CAN_DROP)
    if CAN_DROP:
        drop_files(files)
    (restore, restore_cached), restore_joins = joins.per_layer(lambda: bench.ttft(prefix + questions[4]))
    return {
        "cold_s": cold,
        "repeat_s": repeat,
        "ram_hit_s": ram,
        "ssd_hit_s": ssd,
        "ssd_split_s": split,
        "split_computed_blocks": computed,
        "floor_s": prefix_bytes / raw + ram if raw else float("nan"),
        "raw_read_gib_s": raw / 2**30,
        "restore_s": restore,
        "restore_floor_s": prefix_bytes / raw_cold + ram,
        "raw_cold_read_gib_s": raw_cold / 2**30,
        "repeat_joined_per_layer": repeat_joins,
        "rss_before_repeat_bytes": rss_before,
        "rss_peak_repeat_bytes": rss_peak,
        "ram_blocks_bytes": ram_bytes,
        "restore_joined_per_layer": restore_joins,
        "cached_tokens": {"cold": cold_cached, "ram": ram_cached, "ssd": ssd_cached, "split": split_cached},
        "issue44_cached_tokens": {"repeat": repeat_cached, "restore": restore_cached},
    }


def newest_files(files: list[Path], nbytes: int) -> list[Path]:
    """The most recently written of `files` adding up to at least `nbytes` (all of them if fewer)."""
    chosen, total = [], 0
    for path in sorted(files, key=lambda p: p.stat().st_mtime, reverse=True):
        if total >= nbytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def theirs(loaded, prefix: list[int], questions: list[list[int]]) -> dict:
    """mlx-lm's one-cache path over the same prompts: cold (plain mlx-lm's cold prefill), exact repeat,
    new question."""
    one = OneCache(loaded)
    cold, _ = one.ttft(prefix + questions[0])
    repeat, repeat_reused = one.ttft(prefix + questions[0])
    new, new_reused = one.ttft(prefix + questions[1])
    return {
        "mlx_lm_cold_s": cold,
        "mlx_lm_repeat_s": repeat,
        "mlx_lm_new_question_s": new,
        "mlx_lm_reused_tokens": {"repeat": repeat_reused, "new": new_reused},
    }


def measure_length(
    bench: Bench, loaded, length: int, args: argparse.Namespace, rng: np.random.Generator, joins: JoinCounter
) -> dict:
    reps, warmup_tokens = args.reps, args.warmup_tokens
    vocab = loaded.config["vocab_size"]

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, size=n).tolist()

    warm = ids(min(length, warmup_tokens) if warmup_tokens else length)
    bench.ttft(warm + ids(QUESTION_TOKENS))  # kernels for these shapes, cold and hit paths
    bench.ttft(warm + ids(QUESTION_TOKENS))
    bench.restart(split=False)
    bench.ttft(warm + ids(QUESTION_TOKENS))  # an SSD hit: the read speed the split needs is measured (and kept)
    theirs(loaded, ids(length), [ids(QUESTION_TOKENS) for _ in range(2)])  # its kernels: cold, repeat, new
    prefix_bytes = kv_bytes_per_token(loaded.config, bench.kv_dtype_bytes) * length
    rows = []
    for rep in range(reps):
        prefix = ids(length)
        questions = [ids(QUESTION_TOKENS) for _ in range(5)]
        sides = [
            partial(ours, bench, joins, prefix, questions, prefix_bytes),
            partial(theirs, loaded, prefix, questions),
        ]
        row: dict = {}
        for side in sides if rep % 2 == 0 else sides[::-1]:  # alternated: neither side always runs first
            row.update(side())
            gc.collect()
        row = {
            **row,
            "repeat_over_mlx_lm": row["repeat_s"] / row["mlx_lm_repeat_s"],
            "new_question_over_mlx_lm": row["ram_hit_s"] / row["mlx_lm_new_question_s"],
            "restore_over_floor": row["restore_s"] / row["restore_floor_s"],
            "restore_over_mlx_lm_cold": row["restore_s"] / row["mlx_lm_cold_s"],
        }
        if bench.compute_free:
            row |= copy_floor(row, prefix_bytes)
        print(f"{length} tokens, rep {rep + 1}: {row}", flush=True)
        rows.append(row)
    out = {"prompt_tokens": length + QUESTION_TOKENS, "reps": rows}
    for key in (*MEDIANS, *ISSUE44_MEDIANS, *(LONG_MEDIANS if bench.compute_free else ())):
        out[key] = median([r[key] for r in rows])
    for key in ("repeat_joined_per_layer", "restore_joined_per_layer"):
        out[key] = max(r[key] for r in rows)
    out["split_computed_blocks"] = median([r["split_computed_blocks"] for r in rows])
    out["cold_over_ram"] = out["cold_s"] / out["ram_hit_s"]
    out["cold_over_ssd"] = out["cold_s"] / out["ssd_hit_s"]
    out["cold_over_split"] = out["cold_s"] / out["ssd_split_s"]
    return out


def machine_of(loaded, args: argparse.Namespace) -> dict:
    return machine() | {
        "shape": args.shape,
        "layers": loaded.config["num_hidden_layers"],
        "compute_free": args.compute_free,
        "bits": args.bits,
        "dtype": args.dtype,
        "block_size": bench_block_size(args),
        "kv_bytes_per_token": kv_bytes_per_token(loaded.config, KV_DTYPE_BYTES[args.dtype]),
    }


def bench_block_size(args: argparse.Namespace) -> int:
    from mlx_kvserve.config import load_config

    return args.block_size or load_config().cache.block_size


def report_lines(results: dict) -> list[str]:
    m = results["machine"]
    lines = [
        f"# Long prompts: cold vs RAM hit vs SSD hit after a restart ({m['shape']}, {m['bits']}-bit)",
        "",
        f"Device: {m['device']}; {m['platform']}; mlx {m['mlx']}, mlx-lm {m['mlx_lm']}; "
        f"{m['dtype']} KV ({m['kv_bytes_per_token'] / 1024:g} KiB/token), {m['block_size']}-token blocks.",
        "Engine TTFT (no HTTP), median of the reps; a new 32-token question after the cached prefix.",
        "",
        "| prompt tokens | cold s | RAM hit s | SSD hit s (after restart) | cold / RAM | cold / SSD | plain mlx-lm cold s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["lengths"]:
        lines.append(
            f"| {row['prompt_tokens']} | {row['cold_s']:.3f} | {row['ram_hit_s']:.3f} | {row['ssd_hit_s']:.3f} "
            f"| {row['cold_over_ram']:.1f}x | {row['cold_over_ssd']:.1f}x | {row['mlx_lm_cold_s']:.3f} |"
        )
    lines += [
        "",
        "SSD hit after a restart: every block read vs the first blocks prefilled while the rest are read (split), "
        "next to the floor (the prefix's KV bytes at the raw read bandwidth + the RAM hit).",
        "",
        "| prompt tokens | read s | split s | blocks computed | floor s | read / floor | split / floor | raw read GiB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["lengths"]:
        lines.append(
            f"| {row['prompt_tokens']} | {row['ssd_hit_s']:.3f} | {row['ssd_split_s']:.3f} "
            f"| {row['split_computed_blocks']:g} | {row['floor_s']:.3f} | {row['ssd_hit_s'] / row['floor_s']:.2f}x "
            f"| {row['ssd_split_s'] / row['floor_s']:.2f}x | {row['raw_read_gib_s']:.2f} |"
        )
    lines += issue44_lines(results)
    return lines + long_lines(results, QUESTION_TOKENS) if m["compute_free"] else lines


def issue44_lines(results: dict) -> list[str]:
    """Issue 44's targets: exact repeat and new question <= 1.0x mlx-lm's one-cache path; the restore
    <= 1.5x its floor and faster than plain mlx-lm's cold prefill; a few arrays joined per layer."""
    lines = [
        "",
        "Issue 44: our hits against mlx-lm's own one-cache path (as `mlx_lm.server` keeps one conversation, in "
        "process); the restore after a restart from a cold page cache against its floor (the prefix's bytes at the "
        "raw cold read speed + the RAM hit) and plain mlx-lm's cold prefill; arrays joined per layer by a hit.",
        "",
        "| prompt tokens | exact repeat s: ours / mlx-lm | x | new question s: ours / mlx-lm | x "
        "| restore s | floor s | x floor | mlx-lm cold s | restore / mlx-lm cold | raw cold GiB/s "
        "| joined per layer: repeat / restore |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["lengths"]:
        lines.append(
            f"| {row['prompt_tokens']} | {row['repeat_s']:.3f} / {row['mlx_lm_repeat_s']:.3f} "
            f"| {row['repeat_over_mlx_lm']:.2f}x | {row['ram_hit_s']:.3f} / {row['mlx_lm_new_question_s']:.3f} "
            f"| {row['new_question_over_mlx_lm']:.2f}x | {row['restore_s']:.3f} | {row['restore_floor_s']:.3f} "
            f"| {row['restore_over_floor']:.2f}x | {row['mlx_lm_cold_s']:.3f} | {row['restore_over_mlx_lm_cold']:.2f}x "
            f"| {row['raw_cold_read_gib_s']:.2f} | {row['repeat_joined_per_layer']} / {row['restore_joined_per_layer']} |"
        )
    return lines


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvserve-gpu-"))
    os.environ.setdefault("MLX_KVSERVE_HOME", str(work / "home"))
    try:
        loaded = build_model(args, work / "model")
        bench = Bench(loaded, work, args)
        results: dict = {"machine": machine_of(loaded, args), "lengths": []}
        rng = np.random.default_rng(0)
        joins = JoinCounter()
        for length in (int(n) for n in args.lengths.split(",")):
            bench.start()
            try:
                results["lengths"].append(measure_length(bench, loaded, length, args, rng, joins))
            finally:
                bench.stop()
            shutil.rmtree(work / "kv", ignore_errors=True)  # each length starts on an empty SSD
            write_report(results, Path(args.out), report_lines(results))  # kept if a later length runs out of time
        return results
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
