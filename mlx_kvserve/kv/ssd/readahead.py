"""Asking the kernel to read a chain's block files ahead of their use, so that the disk streams while
the CPU checks the files it already has (the store's reads: reads.py).

Without it a restore alternates: a window of files is read, then checked (keyed checksum, table,
tokens) while the disk idles, then the next window is read. With the files of the chain advised
(posix_fadvise WILLNEED, in order, on a thread of its own: the call may wait for the device's
queue), the disk reads at its sequential speed while the checks run, and the store's own reads
find the pages in memory. The lead is bounded (`ahead_bytes` past the file being read) so that a
long chain never crowds the page cache. Nothing is read into this process; where the platform has
no posix_fadvise (macOS) this does nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from ...safe_files import open_regular

CAN_ADVISE = hasattr(os, "posix_fadvise")
AHEAD_BYTES = 256 * 1024**2  # 32 Llama-3-8B blocks: ~0.1-0.5 s of a disk's sequential reads


class Readahead:
    """Advises `paths` in order, each at most `ahead_bytes` past the one `consumed` last reached.
    `close` stops it (idempotent); a file that cannot be opened is skipped (the read judges it)."""

    def __init__(self, paths: Sequence[Path], ahead_bytes: int = AHEAD_BYTES):
        self._paths = list(paths)
        self._ahead_bytes = ahead_bytes
        self._cond = threading.Condition()  # guards _used, _closed
        self._used = 0  # files the reader is done with
        self._closed = False
        self._thread: threading.Thread | None = None
        if CAN_ADVISE and len(self._paths) > 1:
            self._thread = threading.Thread(target=self._run, name="ssd-readahead", daemon=True)
            self._thread.start()

    def consumed(self, num_files: int) -> None:
        """The reader is done with the first `num_files` files: the lead moves on."""
        with self._cond:
            self._used = max(self._used, num_files)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        sizes: list[int] = []  # bytes of each file advised so far
        for path in self._paths:
            with self._cond:
                while not self._closed and sum(sizes[self._used :]) >= self._ahead_bytes:
                    self._cond.wait()
                if self._closed:
                    return
            sizes.append(_advise(path))


def _advise(path: Path) -> int:
    """Start reading a regular file into the page cache; its size (0 when it cannot be opened)."""
    try:
        fd = open_regular(path)
    except OSError:
        return 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return os.fstat(fd).st_size
    except OSError:
        return 0
    finally:
        os.close(fd)
