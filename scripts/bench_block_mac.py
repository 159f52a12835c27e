"""What authenticating block files costs on the read path (issue 46): the keyed blake3 checksum of
format 4 next to format 3's xxh3-128 and unkeyed blake3, over block payloads of realistic sizes.

For each size: the hash alone over a payload in memory, and a block read as the host path does it
(`readinto` of the file from the page cache into a new buffer, then the hash). The variants alternate
within each repetition, in a shuffled order (the machine is shared and noisy); medians. Then
`read_block_host` itself on a format 4 file of the same size (it also parses the header and checks
the table).

    .venv/bin/python scripts/bench_block_mac.py [--reps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from blake3 import blake3
from xxhash import xxh3_128

from mlx_kvserve.kv.ssd.format import BlockHeader, read_block_host, write_block_file

NS, KEY = b"\x01" * 32, os.urandom(32)
SIZES = {  # name: payload bytes
    "Llama-3-8B 64-token block (128 KiB/token)": 64 * 128 * 1024,
    "SmolLM2-135M 64-token block (22.5 KiB/token)": 64 * 30 * 3 * 64 * 2 * 2,
    "a 4-token tail of SmolLM2-135M": 4 * 30 * 3 * 64 * 2 * 2,
    "16 KiB": 16 * 1024,
}
HASHES = {
    "xxh3-128 (format 3)": lambda view: xxh3_128(view).digest(),
    "blake3": lambda view: blake3(view).digest(),
    "blake3 keyed (format 4)": lambda view: blake3(view, key=KEY).digest(),
}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(size: int, folder: Path, reps: int) -> dict[str, float]:
    """Median ms per block of each variant, for one payload size."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    view = memoryview(data)
    raw = folder / f"raw-{size}.bin"
    raw.write_bytes(data.tobytes())
    block_hash = os.urandom(32)
    block = folder / f"block-{size}.safetensors"
    arrays = {"0.k": mx.array(data[: size // 2]), "0.v": mx.array(data[size // 2 :])}
    write_block_file(block, NS, BlockHeader(block_hash, b"\x00" * 32, (1,), ""), arrays, key=KEY)

    def read_then(hash_fn):
        def run():  # a fresh buffer each time, as read_block_host reads each file into its own
            buf = np.empty(size, dtype=np.uint8)
            with open(raw, "rb", buffering=0) as f:
                f.readinto(memoryview(buf))
            hash_fn(memoryview(buf))

        return run

    variants = {f"hash: {name}": (lambda fn=fn: fn(view)) for name, fn in HASHES.items()}
    variants["read only"] = read_then(lambda _buf: None)
    variants.update({f"read + {name}": read_then(fn) for name, fn in HASHES.items()})
    variants["read_block_host (format 4, as built)"] = lambda: read_block_host(block, NS, block_hash, key=KEY)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):  # each repetition in another order: no variant always follows the same one
        order = list(variants)
        random.Random(rep).shuffle(order)
        for name in order:
            times[name].append(_timed(variants[name]))
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-mac-") as tmp:
        for label, size in SIZES.items():
            results[label] = {"bytes": size, "ms": measure(size, Path(tmp), args.reps)}
    for label, result in results.items():
        ms, size = result["ms"], result["bytes"]
        print(f"\n{label}: {size / 2**20:.3f} MiB")
        for name, value in ms.items():
            print(f"  {name:40s} {value:8.3f} ms  {size / (value / 1e3) / 2**30:6.2f} GiB/s")
        keyed, plain = ms["read + blake3 keyed (format 4)"], ms["read + xxh3-128 (format 3)"]
        print(f"  read path, keyed / format 3: {keyed / plain:.2f}x (+{keyed - plain:.3f} ms per block)")
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu_count": os.cpu_count(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
