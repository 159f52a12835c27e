"""Start a file's writeback early, so that a later fsync finds its data already on the way to the disk.

A batch of block files is written into the page cache and then made durable with one fsync per file;
asking the kernel to start writing each file as soon as it is complete lets the disk work while the
next file is serialized (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`, which returns at once).
Elsewhere (macOS) it does nothing: the fsyncs then do all the work, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():  # noqa: ANN202 - a ctypes function or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
HAS_EARLY_WRITEBACK = _sync_file_range is not None


def start_writeback(path: Path) -> None:
    """Ask the kernel to start writing `path`'s dirty pages now, without waiting; best effort (a
    failure only leaves the work to the fsync). Not a durability step: fsync the file afterwards."""
    if _sync_file_range is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never waits on a FIFO swapped in
    except OSError:
        return
    try:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)
