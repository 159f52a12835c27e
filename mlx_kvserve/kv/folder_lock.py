"""One process per cache folder: an exclusive lock on `<folder>/.lock`.

Two servers on one folder overwrite each other's pins.json and delete each other's (pinned) block
files; an offline `cache verify` deletes a running server's temp files. Whoever changes a store
folder holds its lock first.

Contract:
- `FolderLock.acquire(folder, role)` takes an exclusive, non-blocking flock on `<folder>/.lock`
  (created 0600) and records the holder's pid and role in it. Raises FolderBusyError, naming the
  holder's pid, when another process (or another FolderLock of this process) holds it; OSError
  when the file cannot be created or the filesystem refuses locks.
- The OS releases the lock when the holder's file is closed or its process ends, kill -9 included,
  so a lock is never stale; the file's content only says who held it last and is never trusted for
  anything but a message.
- `release()` is idempotent; a FolderLock that is garbage collected releases too.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import IO, NamedTuple

from ..errors import KVServeError
from .fsmode import FILE_MODE

LOCK_NAME = ".lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MAX_RECORD_BYTES = 4096


class LockHolder(NamedTuple):
    pid: int
    role: str  # "server" or the offline command, e.g. "cache verify"
    since: float  # wall-clock seconds


class FolderBusyError(KVServeError):
    """Another process holds the folder's lock."""

    def __init__(self, folder: Path, holder: LockHolder | None):
        who = f"pid {holder.pid}, {holder.role}" if holder else "pid unknown"
        super().__init__(
            f"the cache folder {folder} is in use by another mlx-kvserve process ({who}); two processes "
            "on one folder would overwrite each other's pins and delete each other's blocks. Stop that "
            "process first, or give this one its own ssd.cache_dir."
        )
        self.folder = folder
        self.holder = holder


class FolderLock:
    def __init__(self, folder: Path, file: IO[str]):
        self.folder = folder
        self._file: IO[str] | None = file  # open while held; closing it releases the lock

    @classmethod
    def acquire(cls, folder: Path, role: str) -> FolderLock:
        """The lock on `folder` (which must exist), or FolderBusyError / OSError; see the module."""
        folder = Path(folder)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW, FILE_MODE)
        file = os.fdopen(fd, "r+")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_holder(file.read(_MAX_RECORD_BYTES))
            file.close()
            raise FolderBusyError(folder, holder) from None
        except BaseException:
            file.close()
            raise
        try:
            os.fchmod(fd, FILE_MODE)  # os.open's mode passes through the umask
            file.truncate(0)
            file.write(json.dumps({"pid": os.getpid(), "role": role, "since": time.time()}))
            file.flush()
        except BaseException:
            file.close()
            raise
        return cls(folder, file)

    @property
    def is_held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        """Give the lock up (closing the file releases it). Safe to call twice."""
        file, self._file = self._file, None
        if file is not None:
            file.close()


def _parse_holder(text: str) -> LockHolder | None:
    try:
        record = json.loads(text)
        pid, role, since = record["pid"], record["role"], record["since"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if type(pid) is not int or not isinstance(role, str) or type(since) not in (int, float) or pid <= 0:
        return None
    return LockHolder(pid, role[:100], float(since))
