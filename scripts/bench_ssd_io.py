"""SSD block I/O per block: save_block and load_block of the real store, and the cost of reading a
block file array by array (what load_block did before it evaluated the loaded arrays at once).

Block shapes: SmolLM2-135M (30 layers x 3 KV heads x 64 dims, float32: 2.9 MB per 64-token
block) and Llama-3-8B (32 layers x 8 KV heads x 128 dims, float16: 8 MB per 64-token block).
Files are read back from the OS page cache (right after writing), as after a server restart.

Usage: .venv/bin/python scripts/bench_ssd_io.py [--blocks 32] [--out results/ssd_io]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from bench_common import median, write_report

from mlx_kvserve.kv.ssd import SSDStore
from mlx_kvserve.kv.ssd_index import block_checksum, block_relpath, parse_metadata

SHAPES = {
    "smollm2-135m f32": (30, 3, 64, mx.float32),
    "llama3-8b f16": (32, 8, 128, mx.float16),
}
NS = b"\x01" * 32


def lazy_read(path: Path, block_hash: bytes) -> None:
    """The old read: mx.load, then the checksum forces each of the lazy arrays on its own."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    header = parse_metadata(meta, NS)
    assert block_checksum(NS, header, arrays) == header.checksum and header.block_hash == block_hash


def measure(shape: tuple, num_blocks: int, block_size: int) -> dict:
    layers, heads, dim, dtype = shape
    folder = Path(tempfile.mkdtemp(prefix="kvserve-ssdio-"))
    try:
        store = SSDStore(folder, NS)
        tokens = tuple(range(block_size))
        blocks = []
        for _ in range(num_blocks):
            arrays = {
                f"{i}.{kv}": mx.random.normal((1, heads, block_size, dim)).astype(dtype)
                for i in range(layers)
                for kv in "kv"
            }
            mx.eval(arrays)
            blocks.append((os.urandom(32), arrays))
        nbytes = sum(a.nbytes for a in blocks[0][1].values())
        start = time.perf_counter()
        for block_hash, arrays in blocks:
            store.save_block(block_hash, NS, tokens, arrays)
        save_ms = (time.perf_counter() - start) / num_blocks * 1e3
        load, lazy = [], []
        for _ in range(3):  # alternate the two reads
            start = time.perf_counter()
            for block_hash, _ in blocks:
                assert store.load_block(block_hash, tokens) is not None
            load.append((time.perf_counter() - start) / num_blocks * 1e3)
            start = time.perf_counter()
            for block_hash, _ in blocks:
                lazy_read(folder / block_relpath(block_hash), block_hash)
            lazy.append((time.perf_counter() - start) / num_blocks * 1e3)
        load_ms, lazy_ms = median(load), median(lazy)
        return {
            "block_mb": nbytes / 1e6,
            "save_ms": save_ms,
            "load_ms": load_ms,
            "lazy_load_ms": lazy_ms,
            "load_gb_s": nbytes / load_ms / 1e6,
            "speedup": lazy_ms / load_ms,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--out", default="results/ssd_io")
    args = parser.parse_args()
    results = {name: measure(shape, args.blocks, args.block_size) for name, shape in SHAPES.items()}
    lines = [
        f"# SSD block I/O ({args.block_size}-token blocks, {args.blocks} blocks, {mx.default_device()})",
        "",
        "| shape | block MB | save_block ms | load_block ms | load GB/s | array-by-array read ms | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['block_mb']:.1f} | {r['save_ms']:.1f} | {r['load_ms']:.1f} | {r['load_gb_s']:.2f} "
            f"| {r['lazy_load_ms']:.1f} | {r['speedup']:.1f}x |"
        )
    write_report(results, Path(args.out), lines)


if __name__ == "__main__":
    main()
