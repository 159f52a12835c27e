"""Store benchmark without a model: SSDStore save and load next to the raw disk of the same folder.

Blocks have the Llama-3-8B shape (32 layers x 8 KV heads x 128 dims, float16, 64 tokens: 8 MiB).
One run, one folder, the same total size for every row:
- raw: one file written sequentially in block-size chunks and fsync'd, then read back from the page
  cache and cold (dropped with posix_fadvise(DONTNEED) after an fsync);
- store: SSDStore.save_block for every block and save_blocks in the writer's batches, then load_block
  for each block and load_blocks for the whole chain (files read together), page cache and cold;
- checksum: the block MAC as built (keyed blake3) next to unkeyed blake3 and format 3's xxh3-128, on the
  same blocks (the stage-by-stage breakdown of a load and a save retired with 77ef6db).
Dropping pages is advisory: on tmpfs "cold" equals "page cache" (the report names the filesystem).
The machine's other work shows up in every figure: compare rows of one run, not runs.

Usage: .venv/bin/python scripts/bench_engine.py ssd-io [--total-gib 1] [--small] [--dir DIR] [--out results/ssd_io]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from blake3 import blake3
from xxhash import xxh3_128

from harness.diskio import CAN_DROP, drop_file, read_file
from harness.reports import median, write_report
from mlx_kvserve.kv.ssd.format import FORMAT_VERSION, BlockHeader, block_checksum, block_relpath
from mlx_kvserve.kv.ssd.store import SaveResult, SSDStore
from mlx_kvserve.kv.ssd.writer import WriteJob

GIB = 1024**3
NS = b"\x01" * 32
PARENT = b"\x00" * 32
KEY = b"\x02" * 32  # a folder's secret (kv/ssd/folder_key.py)
WRITER_BATCH_BYTES = 64 * 2**20  # the SSD writer's default max_batch_bytes


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    tokens: int
    dtype: mx.Dtype = mx.float16

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.heads * self.tokens * self.head_dim * self.dtype.size


LLAMA3_8B = Shape(32, 8, 128, 64)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_payloads(shape: Shape, count: int) -> list[dict[str, mx.array]]:
    """`count` random payloads (random bits do not compress); blocks reuse them under distinct hashes."""
    payloads = []
    for _ in range(count):
        dims = (1, shape.heads, shape.tokens, shape.head_dim)
        arrays = {f"{i}.{kv}": mx.random.normal(dims).astype(shape.dtype) for i in range(shape.layers) for kv in "kv"}
        mx.eval(arrays)
        payloads.append(arrays)
    return payloads


def raw_write(path: Path, num_chunks: int, chunk: memoryview) -> float:
    """Seconds to write num_chunks x chunk sequentially into one new file and fsync it."""

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(num_chunks):
                done = 0
                while done < len(chunk):
                    done += os.write(fd, chunk[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    return timed(write)


def read_pass(paths: list[Path], cold: bool, read: Callable[[Path], object]) -> float:
    """Seconds to read every path with `read`; a cold pass drops each file from the page cache first."""
    if cold:
        for path in paths:
            drop_file(path)
    return timed(lambda: [read(path) for path in paths])


def save_pass(store: SSDStore, hashes: list[bytes], tokens: tuple, payloads: list[dict[str, mx.array]]) -> float:
    """Seconds to save_block every hash (each a new block) into `store`."""

    def save_all() -> None:
        for i, block_hash in enumerate(hashes):
            assert store.save_block(block_hash, PARENT, tokens, payloads[i % len(payloads)]) is SaveResult.SAVED

    return timed(save_all)


def batched_save_pass(
    store: SSDStore, hashes: list[bytes], tokens: tuple, payloads: list[dict[str, mx.array]], batch_bytes: int
) -> float:
    """Seconds to save every hash with save_blocks in batches of `batch_bytes` (as the SSD writer does)."""
    jobs = [WriteJob(h, PARENT, tokens, payloads[i % len(payloads)]) for i, h in enumerate(hashes)]
    per_batch = max(1, batch_bytes // sum(a.nbytes for a in payloads[0].values()))

    def save_all() -> None:
        for start in range(0, len(jobs), per_batch):
            results = store.save_blocks(jobs[start : start + per_batch])
            assert all(r is SaveResult.SAVED for r in results), results

    return timed(save_all)


def io_bandwidth(folder: Path, shape: Shape, num_blocks: int, reps: int) -> tuple[dict, SSDStore, list]:
    """Raw and store bandwidth (GiB/s, medians of `reps`) on the same folder and total; raw and store
    passes alternate, so that the machine's other work falls on both. Also returns the store of the
    first save pass and its (hash, path) blocks, for the checksum measurements."""
    total = num_blocks * shape.block_bytes
    chunk = memoryview(np.random.default_rng(0).integers(0, 256, shape.block_bytes, dtype=np.uint8))
    payloads = make_payloads(shape, min(num_blocks, 4))
    tokens = tuple(range(shape.tokens))
    raw_path, hashes = folder / "raw.bin", [os.urandom(32) for _ in range(num_blocks)]
    store = SSDStore(folder / "store", NS)
    modes = ["page_cache", "cold"] if CAN_DROP else ["page_cache"]
    loads = ("raw_read", "store_load", "store_load_chain", "store_load_chain_host")
    kinds = ["raw_write", "store_save", "store_save_batched"] + [f"{k}_{mode}" for k in loads for mode in modes]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for rep in range(reps):  # later reps save into a throwaway store: a saved block is not written again
        times["raw_write"].append(raw_write(raw_path, num_blocks, chunk))
        target = store if rep == 0 else SSDStore(folder / f"store{rep}", NS)
        times["store_save"].append(save_pass(target, hashes, tokens, payloads))
        if target is not store:
            shutil.rmtree(target.cache_dir)
        batched = SSDStore(folder / f"batched{rep}", NS)
        times["store_save_batched"].append(batched_save_pass(batched, hashes, tokens, payloads, WRITER_BATCH_BYTES))
        shutil.rmtree(batched.cache_dir)
    paths = [store.cache_dir / block_relpath(h) for h in hashes]
    by_path = dict(zip(paths, hashes, strict=True))
    buf = memoryview(bytearray(shape.block_bytes))

    def load(path: Path) -> None:
        if store.load_block(by_path[path], tokens) is None:
            raise RuntimeError(f"load_block missed {path.name}")

    def load_chain(host: bool) -> None:  # one call for every block, as a lookup of one long prefix does
        store.host_reads = host
        got = store.load_blocks([(h, tokens) for h in hashes])
        if len(got) != len(hashes):
            raise RuntimeError("load_blocks missed")
        mx.eval([b.arrays for b in got])  # the views (host reads: after their copy into mlx)

    store.host_reads = False  # load_block: through mlx (the CPU's and Apple GPUs' path)

    for _ in range(reps):
        for mode in modes:
            times[f"raw_read_{mode}"].append(read_pass([raw_path], mode == "cold", lambda p: read_file(p, buf)))
            times[f"store_load_{mode}"].append(read_pass(paths, mode == "cold", load))
            for kind, host in (("store_load_chain", False), ("store_load_chain_host", True)):
                if mode == "cold":
                    for path in paths:
                        drop_file(path)
                times[f"{kind}_{mode}"].append(timed(lambda host=host: load_chain(host)))
            store.host_reads = False
    raw_path.unlink()
    result = {"total_gib": total / GIB, "num_blocks": num_blocks, "reps": reps}
    result.update({name: total / median(ts) / GIB for name, ts in times.items()})
    result["save_vs_raw"] = result["store_save"] / result["raw_write"]
    result["save_batched_vs_raw"] = result["store_save_batched"] / result["raw_write"]
    for mode in modes:
        result[f"load_vs_raw_{mode}"] = result[f"store_load_{mode}"] / result[f"raw_read_{mode}"]
        result[f"load_chain_vs_raw_{mode}"] = result[f"store_load_chain_{mode}"] / result[f"raw_read_{mode}"]
        result[f"load_chain_host_vs_raw_{mode}"] = result[f"store_load_chain_host_{mode}"] / result[f"raw_read_{mode}"]
    return result, store, list(zip(hashes, paths, strict=True))


def checksum_costs(store: SSDStore, blocks: list[tuple[bytes, Path]], tokens: tuple, reps: int) -> dict[str, float]:
    """Median ms per block of the block MAC as built (keyed blake3 over the file's payload, format 4) next
    to unkeyed blake3 and format 3's xxh3-128 on the same bytes in memory (what authenticating costs)."""
    header = BlockHeader(PARENT, PARENT, (1,), "")
    times: dict[str, list[float]] = {}
    for block_hash, path in blocks:
        arrays, data = store.load_block(block_hash, tokens).arrays, path.read_bytes()
        designs = {
            f"block_checksum as built (format v{FORMAT_VERSION}, keyed blake3)": partial(
                block_checksum, NS, header, arrays, key=KEY
            ),
            "blake3 file bytes, unkeyed": partial(blake3, data),
            "xxh3-128 file bytes (format 3)": partial(xxh3_128, data),
        }
        for _ in range(reps):
            for name, fn in designs.items():
                times.setdefault(name, []).append(timed(fn))
    return {name: median(ts) * 1e3 for name, ts in times.items()}


def filesystem_of(folder: Path) -> str:
    """The mount's filesystem type from /proc/mounts (Linux), else 'unknown'."""
    best, fs = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            mount, kind = line.split()[1:3]
            if Path(mount) in (folder.resolve(), *folder.resolve().parents) and len(mount) > len(best):
                best, fs = mount, kind
    except OSError:
        pass
    return fs


def measure(total_bytes: int, folder: Path, shape: Shape = LLAMA3_8B, reps: int = 2) -> dict:
    """Measure everything in a fresh subfolder of `folder` (removed afterwards); returns the results."""
    work = Path(tempfile.mkdtemp(prefix="kvserve-ssdio-", dir=folder))
    try:
        num_blocks = max(1, total_bytes // shape.block_bytes)
        bandwidth, store, blocks = io_bandwidth(work, shape, num_blocks, reps)
        return {
            "folder": str(folder),
            "filesystem": filesystem_of(folder),
            "device": str(mx.default_device()),
            "cpu_count": os.cpu_count(),
            "block_mib": shape.block_bytes / 2**20,
            "gib_s": bandwidth,
            "checksum_ms": checksum_costs(store, blocks[:4], tuple(range(shape.tokens)), reps=3),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report_lines(r: dict) -> list[str]:
    bw, mib = r["gib_s"], r["block_mib"]
    lines = [
        f"# Store benchmark, no model ({bw['num_blocks']} blocks of {mib:.0f} MiB = {bw['total_gib']:.2f} GiB; "
        f"{r['filesystem']} at {r['folder']}; {r['device']}, {r['cpu_count']} CPUs)",
        "",
        "| GiB/s | raw file I/O | SSDStore | store / raw |",
        "|---|---|---|---|",
        f"| write (+fsync) / save_block | {bw['raw_write']:.2f} | {bw['store_save']:.2f} | {bw['save_vs_raw']:.2f}x |",
        f"| write (+fsync) / save_blocks, batches of {WRITER_BATCH_BYTES // 2**20} MiB | {bw['raw_write']:.2f} "
        f"| {bw['store_save_batched']:.2f} | {bw['save_batched_vs_raw']:.2f}x |",
    ]
    for mode in ("page_cache", "cold"):
        if f"raw_read_{mode}" in bw:
            lines.append(
                f"| read / load_block, {mode.replace('_', ' ')} | {bw[f'raw_read_{mode}']:.2f} "
                f"| {bw[f'store_load_{mode}']:.2f} | {bw[f'load_vs_raw_{mode}']:.2f}x |"
            )
            lines.append(
                f"| read / load_blocks (a chain), {mode.replace('_', ' ')} | {bw[f'raw_read_{mode}']:.2f} "
                f"| {bw[f'store_load_chain_{mode}']:.2f} | {bw[f'load_chain_vs_raw_{mode}']:.2f}x |"
            )
            lines.append(
                f"| read / load_blocks through host memory, {mode.replace('_', ' ')} | {bw[f'raw_read_{mode}']:.2f} "
                f"| {bw[f'store_load_chain_host_{mode}']:.2f} | {bw[f'load_chain_host_vs_raw_{mode}']:.2f}x |"
            )
    lines += ["", "| block checksum | ms per block | GiB/s |", "|---|---|---|"]
    for name, ms in r["checksum_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | {mib / 1024 / ms * 1e3:.2f} |")
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--total-gib", type=float, default=1.0, help="bytes to save and load (default 1 GiB)")
    parser.add_argument("--small", action="store_true", help="a quick run: 64 MiB")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="folder on the disk to test")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/ssd_io"))


def run(args: argparse.Namespace) -> dict:
    total_gib = 1 / 16 if args.small else args.total_gib
    results = measure(int(total_gib * GIB), args.dir, reps=max(1, args.reps))
    write_report(results, args.out, report_lines(results))
    return results
