"""Plain disk reads and writes, and dropping files from the page cache: the physical floors the SSD
benches measure the store against, in the same run and folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

CAN_DROP = hasattr(os, "posix_fadvise")  # Linux; macOS has no posix_fadvise


def drop_file(path: Path) -> None:
    """Evict a file's pages from the page cache (after an fsync: dirty pages cannot be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path: Path, buf: memoryview) -> int:
    """Read a whole file sequentially in len(buf) chunks with plain os reads; returns the bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def block_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.safetensors") if p.is_file() and ".tmp" not in p.name]  # not saves in progress


def drop_files(paths: list[Path]) -> None:
    for path in paths:
        drop_file(path)


def raw_read_s(paths: list[Path], cold: bool) -> float:
    """Seconds to read `paths` with plain sequential reads (the disk's floor for these bytes)."""
    if cold:
        drop_files(paths)
    buf = memoryview(bytearray(8 << 20))
    start = time.perf_counter()
    for path in paths:
        read_file(path, buf)
    return time.perf_counter() - start


def raw_write_bps(folder: Path, nbytes: int) -> float:
    """Bytes per second of one sequential write of `nbytes` in 8 MiB chunks, then fsync."""
    chunk = memoryview(os.urandom(8 << 20))
    path = folder / "raw-write.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(len(chunk), left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return nbytes / elapsed
