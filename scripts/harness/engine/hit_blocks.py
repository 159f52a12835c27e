"""A cache hit's cost against the block size (issue 44, item 2), in-process, on a deep narrow model.

A random float32 llama of 48 layers with 2 KV heads x 16 dims (`deep-narrow`: per token little
compute and little KV, so what shows is the hit's own cost per block and per layer) holds a
`--tokens`-long prompt in its block cache, registered by the product's PrefixCache as a finished
request registers it (the positions' KV is random: no 16k-token cold prefill is needed to time a hit).
For each block size, two variants side by side, alternated, medians of `--reps`:

- runs: the blocks as registered, views of one copy per layer (kv/runs.py): a hit joins one piece
  per run per layer;
- per block: the same blocks each owning its own arrays (as blocks read back from the SSD are): a
  hit joins one array per block per layer (what every hit did before runs).

Measured per variant: exact-repeat TTFT, new-question TTFT (the last 64 tokens differ), the arrays
joined per layer on the hit (the join's inputs: pieces, tail, room), and the hit's peak memory up
to its first token above what was allocated before it, as a multiple of the prefix's KV bytes (one
copy = 1.0x; decoding later grows the cache as mlx-lm does, a cold run's alike). The
floor beside them: one memory copy of the prefix's bytes.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_engine.py hit-blocks [--tokens 16384]
        [--block-sizes 16 64 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

import mlx.core as mx

from harness import ROOT
from harness.hits import JoinCounter
from harness.kvstack import KVStack
from harness.reports import median, write_report
from harness.synthetic import load_bench_model
from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.engine.batch.scheduler import Scheduler
from mlx_kvserve.engine.cache.prefix_cache import PrefixCache
from mlx_kvserve.engine.request import GenerationRequest, SamplingParams
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.kv.tails import TailStore

VARIANTS = ("runs", "per block")
QUESTION = 64  # tokens a new question replaces at the prompt's end


def _stack(
    model, tokenizer, bs: int, prompt: list[int], kv_shape: tuple[int, int], per_block: bool
) -> tuple[KVStack, float]:
    """A KVStack whose block cache holds `prompt` (random KV of `kv_shape`: heads, head dim),
    registered by PrefixCache as a finished request's, and the seconds that registration took."""
    hasher = BlockHasher(namespace_hash("bench-hit-blocks", "float32", bs), bs)
    manager = KVManager(hasher, RAMStore(16 << 30), TailStore(1 << 30))
    prefix_cache = PrefixCache(model, manager)
    prepared = prefix_cache.prepare(prompt)
    cache = prefix_cache.layout.new_cache()
    mx.random.seed(0)
    for lo in range(0, len(prompt), 4096):  # what a prefill leaves in the cache, in steps
        n = min(4096, len(prompt) - lo)
        for c in cache:
            k = mx.random.normal((1, kv_shape[0], n, kv_shape[1]))
            c.update_and_fetch(k, k * 0.5)
        mx.eval([c.keys for c in cache])
    prepared.prompt_cache = cache
    start = time.perf_counter()
    prefix_cache.finish(prepared, prompt, len(prompt))
    register_s = time.perf_counter() - start
    if per_block:  # the same blocks, each owning its arrays: no run to slice
        match = manager.lookup(prompt)
        for block in match.blocks:
            block.payload = [None if e is None else tuple(mx.array(a) for a in e) for e in block.payload]
            mx.eval([a for e in block.payload if e is not None for a in e])
        manager.release(match.blocks)
    return KVStack(Scheduler(model, tokenizer, prefix_cache)), register_s


def _hit(gen: KVStack, prompt: list[int], counter: JoinCounter) -> tuple[float, int, int, int]:
    """(TTFT s, cached tokens, peak bytes above the start up to the first token, arrays joined per layer)."""
    events: list = []
    peaks: list[int] = []

    def emit(event) -> None:  # the first event is the first token's: decoding (its cache growth) comes after
        if not peaks:
            peaks.append(mx.get_peak_memory())
        events.append(event)

    req = GenerationRequest("bench", prompt, SamplingParams(max_tokens=1), emit)
    gc.collect()  # an earlier stack's arrays freed by a collection inside the hit would hide its own peak
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    counter.counts.clear()
    gen.run(req)
    done = events[-1]
    joins = counter.counts[0] if counter.counts else 0
    return done.first_token_s, done.usage.cached_tokens, peaks[0] - before, joins


class _CopyFloor:
    """One memory copy of `nbytes` (a join of two halves: one pass, no arithmetic), timed beside the hits."""

    def __init__(self, nbytes: int):
        self.flat = mx.zeros((nbytes // 4,), mx.float32) + 1
        mx.eval(self.flat)
        self.times: list[float] = []
        self.time()  # unmeasured: the first fills fresh pages

    def time(self) -> None:
        half = self.flat.size // 2
        start = time.perf_counter()
        mx.eval(mx.concatenate([self.flat[:half], self.flat[half:]]))
        self.times.append(time.perf_counter() - start)


def measure(tokens: int, block_sizes: list[int], reps: int, shape: str = "deep-narrow") -> list[dict]:
    loaded = load_bench_model(None, shape, "hit-blocks-")
    model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.config
    heads = config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rng = random.Random(0)
    vocab = loaded.config["vocab_size"]
    prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
    prefix_bytes = tokens * len(model.layers) * 2 * heads * dim * 4
    floor = _CopyFloor(prefix_bytes)
    counter = JoinCounter()
    rows = []
    for bs in block_sizes:
        built = {v: _stack(model, tokenizer, bs, prompt, (heads, dim), v == "per block") for v in VARIANTS}
        stacks = {v: gen for v, (gen, _) in built.items()}
        got: dict[str, dict[str, list]] = {v: {"repeat": [], "new": [], "peak": [], "joins": []} for v in VARIANTS}
        for v in VARIANTS:  # unmeasured: the first run of a stack warms what later ones reuse
            _hit(stacks[v], prompt, counter)
        for rep in range(reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            floor.time()
            for v in order:
                ttft, cached, peak, joins = _hit(stacks[v], prompt, counter)
                assert cached == tokens - 1, (v, bs, cached)
                got[v]["repeat"].append(ttft)
                got[v]["peak"].append(peak)
                got[v]["joins"].append(joins)
            question = prompt[:-QUESTION] + [rng.randrange(3, vocab) for _ in range(QUESTION)]
            for v in order:  # one new question per rep: its own blocks are registered after it
                got[v]["new"].append(_hit(stacks[v], question, counter)[0])
        row = {"block_size": bs, "tokens": tokens, "blocks": tokens // bs, "prefix_mib": prefix_bytes / 2**20}
        row["register_s"] = built["runs"][1]
        row["copy_floor_s"] = median(floor.times[1:])
        floor.times[1:] = []
        for v in VARIANTS:
            key = v.replace(" ", "_")
            row[f"{key}_repeat_s"] = median(got[v]["repeat"])
            row[f"{key}_new_question_s"] = median(got[v]["new"])
            row[f"{key}_joined_per_layer"] = max(got[v]["joins"])
            row[f"{key}_peak_x_prefix"] = max(got[v]["peak"]) / prefix_bytes
        rows.append(row)
        print(row, flush=True)
        del stacks, built
    return rows


def report(rows: list[dict]) -> list[str]:
    largest = max(rows, key=lambda r: r["block_size"])
    lines = [
        f"{rows[0]['tokens']} tokens, {rows[0]['prefix_mib']:.0f} MiB of KV. TTFT s, medians; one memory copy of the "
        "prefix's bytes (the floor) timed beside them.",
        "",
        "| block size | blocks | joined per layer: runs / per block | exact repeat: runs | per block | per block / runs "
        f"| runs / runs at {largest['block_size']} | copy floor | new question: runs | per block | hit peak (x prefix) "
        "| register s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block_size']} | {r['blocks']} | {r['runs_joined_per_layer']} / {r['per_block_joined_per_layer']} | "
            f"{r['runs_repeat_s']:.3f} | {r['per_block_repeat_s']:.3f} | "
            f"{r['per_block_repeat_s'] / r['runs_repeat_s']:.1f}x | {r['runs_repeat_s'] / largest['runs_repeat_s']:.2f}x | "
            f"{r['copy_floor_s']:.3f} | {r['runs_new_question_s']:.3f} | {r['per_block_new_question_s']:.3f} | "
            f"{r['runs_peak_x_prefix']:.2f} | {r['register_s']:.2f} |"
        )
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shape", default="deep-narrow", help="a synthetic llama shape (harness/synthetic.py SHAPES)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "hit_blocks")


def run(args: argparse.Namespace) -> None:
    rows = measure(args.tokens, args.block_sizes, args.reps, args.shape)
    lines = report(rows)
    print("\n".join(lines))
    write_report({"rows": rows}, args.out, lines)
