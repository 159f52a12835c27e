"""Opening files in the server's folders without ever waiting on what someone put there.

Anything may sit at a path the server reads or writes: a FIFO, a device, a folder, a link. A plain
open() of a FIFO waits for the other end, in a thread that may hold the GIL (mx.load) or a lock
(pins), and the whole server hangs. So every file in the cache folders is opened here:

- `open_regular(path)`: O_RDONLY | O_NONBLOCK (and O_NOFOLLOW unless `follow_links`), then fstat:
  only a regular file gets through (NotRegularFileError, an OSError, for anything else), and
  O_NONBLOCK is cleared before the caller reads (checked_json reads every bookkeeping file so).
- `regular_path(path)`: the same check for a library that opens by name (mx.load). It yields a
  name for the checked descriptor (`/dev/fd/N`), so a file swapped in after the check is never the
  one read; where the system has no /dev/fd, the checked path itself (a swap in between then needs
  a local process that can write the folder, which could do worse).
- `create_new(path)`: a fresh file for writing, mode `mode` whatever the umask. Whatever was at the
  path (a stale temp file, a FIFO, a link, an empty folder) is removed first, then the file is
  created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK): the open never waits for a
  reader and never writes through a link. Only for paths this process owns (temp files).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FD_FOLDER = "/dev/fd"
_HAS_FD_FOLDER = os.path.isdir(_FD_FOLDER)


class NotRegularFileError(OSError):
    """Something other than a regular file where the server reads one; the message names its kind."""


def kind_of(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
        stat.S_ISLNK: "a link",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a plain file")


def open_regular(path: Path | str, follow_links: bool = False) -> int:
    """A descriptor of the regular file at `path`, opened for reading in blocking mode; the
    caller closes it. Raises FileNotFoundError, NotRegularFileError (a FIFO, device, folder, or a
    link unless `follow_links`), or another OSError. Never waits on a FIFO or device."""
    flags = os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | (0 if follow_links else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_links and _is_link(path):  # O_NOFOLLOW reports a link as ELOOP (EMLINK on BSD)
            raise NotRegularFileError(f"not a regular file ({kind_of(stat.S_IFLNK)})") from None
        if isinstance(exc, IsADirectoryError):
            raise NotRegularFileError(f"not a regular file ({kind_of(stat.S_IFDIR)})") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(f"not a regular file ({kind_of(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def regular_path(path: Path | str) -> Iterator[str]:
    """A name under which a library may open the regular file at `path` (never through a link),
    valid inside the `with`. Raises as `open_regular`."""
    fd = open_regular(path)
    try:
        yield f"{_FD_FOLDER}/{fd}" if _HAS_FD_FOLDER else str(path)
    finally:
        os.close(fd)


def create_new(path: Path | str, mode: int = 0o600) -> int:
    """A descriptor of a new, empty regular file at `path`, open for writing, with `mode` (fchmod:
    the umask does not apply); the caller closes it. Whatever was at `path` is removed first (a
    non-empty folder raises OSError). Raises OSError; never waits on a FIFO."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        _remove_stale(path)
        fd = os.open(path, flags, mode)  # a second racer wins with FileExistsError: nothing is overwritten
    try:
        os.fchmod(fd, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_stale(path: Path | str) -> None:
    """Remove a file, link, FIFO or empty folder at `path` (unlink never opens what it removes)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _is_link(path: Path | str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False
