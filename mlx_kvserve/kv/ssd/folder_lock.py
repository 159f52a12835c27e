"""Who may change a cache folder: one owner (an exclusive lock on `<folder>/.lock`) and any number
of guest servers (shared locks on `<folder>/.guests.lock`).

Blocks are immutable and content-addressed, so several servers of one model can share a folder:
the first server owns it (eviction, TTL pruning, pins, the index file, the shutdown record); a
server that finds it owned by another server joins as a guest, which reads every block and adds
its own (atomic renames of complete files) but never deletes a file or writes the bookkeeping.
An offline command (`cache verify`) deletes temp files and damaged blocks, so it needs the folder
to itself: no owner and no guest.

Contract:
- `FolderLock.acquire(folder, role)` (offline commands) takes an exclusive, non-blocking flock on
  `<folder>/.lock` and on `<folder>/.guests.lock` (both created 0600) and records the holder's pid
  and role in `.lock`. Raises FolderBusyError when another process (or another FolderLock of this
  process) holds either; OSError when a file cannot be created or the filesystem refuses locks.
- `FolderLock.acquire_server(folder)` takes the owner's lock (role "server") when it is free, else,
  when a server owns the folder, a shared lock on `.guests.lock`: `is_owner` says which. Raises
  FolderBusyError when an offline command holds the folder.
- The OS releases the lock when the holder's file is closed or its process ends, kill -9 included,
  so a lock is never stale; the file's content only says who held it last and is never trusted for
  anything but a message.
- `release()` is idempotent; a FolderLock that is garbage collected releases too.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from pathlib import Path
from typing import IO, NamedTuple

from ...errors import KVServeError
from ...fsmode import FILE_MODE

LOCK_NAME = ".lock"
GUESTS_LOCK_NAME = ".guests.lock"
SERVER_ROLE = "server"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MAX_RECORD_BYTES = 4096


class LockHolder(NamedTuple):
    pid: int
    role: str  # "server" or the offline command, e.g. "cache verify"
    since: float  # wall-clock seconds


class FolderBusyError(KVServeError):
    """Another process holds the folder's lock."""

    def __init__(self, folder: Path, holder: LockHolder | None, guests: bool = False):
        if guests:
            who = "servers sharing it as guests"
        else:
            who = f"pid {holder.pid}, {holder.role}" if holder else "pid unknown"
        super().__init__(
            f"the cache folder {folder} is in use by another mlx-kvserve process ({who}); this command "
            "deletes files a running server may be writing. Stop that process first, or give this one "
            "its own ssd.cache_dir."
        )
        self.folder = folder
        self.holder = holder


class FolderLock:
    def __init__(self, folder: Path, files: list[IO[str]], is_owner: bool = True, owner: LockHolder | None = None):
        self.folder = folder
        self._files: list[IO[str]] = files  # open while held; closing them releases the locks
        self.is_owner = is_owner  # False: a guest server (see the module)
        self.owner = owner  # a guest's view of the owner when it joined (for messages)

    @classmethod
    def acquire(cls, folder: Path, role: str) -> FolderLock:
        """The folder to itself (owner lock + no guests), or FolderBusyError / OSError; see the module."""
        folder = Path(folder)
        owner = _open_lock_file(folder / LOCK_NAME)
        if not _try_flock(owner, fcntl.LOCK_EX):
            holder = _parse_holder(owner.read(_MAX_RECORD_BYTES))
            owner.close()
            raise FolderBusyError(folder, holder)
        try:
            guests = _open_lock_file(folder / GUESTS_LOCK_NAME)
        except BaseException:
            owner.close()
            raise
        if not _try_flock(guests, fcntl.LOCK_EX):
            guests.close()
            owner.close()
            raise FolderBusyError(folder, None, guests=True)
        _record(owner, role)
        return cls(folder, [owner, guests])

    @classmethod
    def acquire_server(cls, folder: Path) -> FolderLock:
        """The owner's lock, or a guest's when another server owns the folder; see the module."""
        folder = Path(folder)
        owner = _open_lock_file(folder / LOCK_NAME)
        if _try_flock(owner, fcntl.LOCK_EX):
            _record(owner, SERVER_ROLE)
            return cls(folder, [owner])
        holder = _parse_holder(owner.read(_MAX_RECORD_BYTES))
        owner.close()
        if holder is not None and holder.role != SERVER_ROLE:
            raise FolderBusyError(folder, holder)
        guests = _open_lock_file(folder / GUESTS_LOCK_NAME)
        if not _try_flock(guests, fcntl.LOCK_SH):  # an offline command holds it
            guests.close()
            raise FolderBusyError(folder, holder)
        return cls(folder, [guests], is_owner=False, owner=holder)

    @property
    def is_held(self) -> bool:
        return bool(self._files)

    def has_guests(self) -> bool:
        """Whether guest servers share the folder now (an owner's question; a guest: always True)."""
        if not self.is_owner:
            return True
        try:
            probe = _open_lock_file(self.folder / GUESTS_LOCK_NAME)
        except OSError:
            return False
        try:
            return not _try_flock(probe, fcntl.LOCK_EX)
        finally:
            probe.close()  # releases the probe's lock, if it got it

    @property
    def role(self) -> str:
        return "owner" if self.is_owner else "guest"

    def release(self) -> None:
        """Give the locks up (closing the files releases them). Safe to call twice."""
        files, self._files = self._files, []
        for file in files:
            file.close()


def _open_lock_file(path: Path) -> IO[str]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        os.fchmod(fd, FILE_MODE)  # os.open's mode passes through the umask
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "r+")


def _try_flock(file: IO[str], kind: int) -> bool:
    """Whether the non-blocking flock was taken; other errors close nothing and raise."""
    try:
        fcntl.flock(file.fileno(), kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except BaseException:
        file.close()
        raise


def _record(file: IO[str], role: str) -> None:
    try:
        file.truncate(0)
        file.write(json.dumps({"pid": os.getpid(), "role": role, "since": time.time()}))
        file.flush()
    except BaseException:
        file.close()
        raise


def _parse_holder(text: str) -> LockHolder | None:
    try:
        record = json.loads(text)
        pid, role, since = record["pid"], record["role"], record["since"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if type(pid) is not int or not isinstance(role, str) or type(since) not in (int, float) or pid <= 0:
        return None
    return LockHolder(pid, role[:100], float(since))
