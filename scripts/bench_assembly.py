"""Cache-hit assembly cost per GiB (issue 11, item 3), next to a plain memory copy of the same bytes.

No model: blocks of a Llama-3-8B-shaped KV (32 layers, 8 KV heads, head dim 128, fp16: 128 KiB per token,
64-token blocks of 8 MiB) are made in memory. Timed, each the median of `--reps`:

- copy: one contiguous copy of all those bytes (the memory floor);
- assemble: `CacheLayout.assemble` (a fresh prompt cache holding the blocks: one concatenation per layer);
- assemble + batch: that, then mlx-lm's `BatchKVCache.merge` (what `BatchGenerator.insert` does with it).

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_assembly.py [--tokens 2048 8192]
        [--block-sizes 16 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from harness import ROOT
from harness.reports import write_report
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_kvserve.kv import blocks

LAYERS, HEADS, DIM, BS = 32, 8, 128, 64


class _ShapeOnly:
    """Just what CacheLayout needs of a model: its caches (and no parameters)."""

    layers = [object()] * LAYERS

    def make_cache(self):
        return [KVCache() for _ in range(LAYERS)]

    def parameters(self):
        return {}


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(tokens: int, reps: int, bs: int = BS) -> dict:
    layout = blocks.cache_layout(_ShapeOnly(), bs)
    n = tokens // bs
    payloads = [
        [(mx.random.normal((1, HEADS, bs, DIM)).astype(mx.float16),) * 2 for _ in range(LAYERS)] for _ in range(n)
    ]
    mx.eval([a for p in payloads for e in p for a in e])
    nbytes = sum(a.nbytes for p in payloads for e in p for a in e)
    flat = mx.random.normal((nbytes // 2,)).astype(mx.float16)
    mx.eval(flat)

    half = flat.size // 2

    def copy():  # a concatenation of two halves: one pass over the bytes, no arithmetic
        mx.eval(mx.concatenate([flat[:half], flat[half:]]))

    def assemble():
        mx.eval([c.keys for c in layout.assemble(payloads)])

    def assemble_batch():
        cache = layout.assemble(payloads)
        merged = [BatchKVCache.merge([c]) for c in cache]
        mx.eval([c.keys for c in merged] + [c.values for c in merged])

    out = {"tokens": tokens, "block_size": bs, "gib": nbytes / 2**30}
    for name, fn in (("copy", copy), ("assemble", assemble), ("assemble_batch", assemble_batch)):
        fn()  # warm
        out[name + "_s"] = _timed(fn, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[BS], help="tokens per block (64: the default)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "assembly")
    args = ap.parse_args()
    rows = [measure(t, args.reps, bs) for t in args.tokens for bs in args.block_sizes]
    lines = [
        "| tokens | block size | GiB | copy (ms) | assemble (ms) | assemble + batch merge (ms) | assemble ms/GiB | "
        "+ merge ms/GiB | assemble / copy | + merge / copy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, a, b, g = r["copy_s"], r["assemble_s"], r["assemble_batch_s"], r["gib"]
        lines.append(
            f"| {r['tokens']} | {r['block_size']} | {g:.2f} | {c * 1e3:.0f} | {a * 1e3:.0f} | {b * 1e3:.0f} | {a * 1e3 / g:.0f} | "
            f"{b * 1e3 / g:.0f} | {a / c:.1f}x | {b / c:.1f}x |"
        )
    write_report({"rows": rows}, args.out, lines)


if __name__ == "__main__":
    main()
