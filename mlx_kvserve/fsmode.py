"""Private files and folders: everything the server writes under its cache holds prompt contents.

Contract:
- `private_mkdir` creates a folder, and any missing parents, mode 0700 whatever the umask; a folder
  that exists already is left as it is (its mode is not ours to change).
- `open_private` opens a new file for writing, mode 0600 whatever the umask: whatever was at the
  path (a stale temp file, a FIFO, a link) is replaced, never written through nor waited on (see
  safe_files.create_new). Every caller writes a temp file it then renames into place.
  `create_private` makes an empty one for a library that then writes into it (mx.save_safetensors
  creates files 0644 itself, but keeps the mode of a file it overwrites).
- `ensure_private_root` creates the cache root 0700, or checks an existing one: another user's
  folder, or one that others may read or enter, raises ConfigError and is never chmod-ed (a folder
  somebody shares on purpose is not ours to close).
The umask is never touched: it is process-wide, and other threads create files of their own.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

from .errors import ConfigError
from .safe_files import create_new

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_mkdir(path: Path) -> None:
    """Create `path` and its missing parents, each 0700. Raises OSError (FileExistsError when
    something other than a folder is in the way)."""
    path = Path(path)
    if path.is_dir():
        return
    if not path.parent.is_dir():
        private_mkdir(path.parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if path.is_dir():
            return  # made meanwhile by another thread, which sets its mode
        raise
    os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask; chmod's does not


def open_private(path: Path, mode: str = "wb") -> IO:
    """A new file at `path` opened for writing ("w" or "wb"), mode 0600; whatever was there is
    replaced. Raises OSError."""
    fd = create_new(path, FILE_MODE)
    try:
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def create_private(path: Path) -> None:
    """An empty file at `path`, mode 0600, for another library to write into. Raises OSError."""
    open_private(path).close()


def ensure_private_root(path: Path, setting: str) -> None:
    """Create the folder `setting` names 0700 when missing; raise ConfigError when it exists and is
    not a folder, is owned by another user, or has any group or other permission bit set. Raises
    OSError when it cannot be created or inspected."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        private_mkdir(path)
        return
    why = ""
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a folder"
    elif st.st_uid != os.getuid():
        why = f"belongs to another user (uid {st.st_uid}; this process runs as uid {os.getuid()})"
    elif st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        why = f"is open to other users (mode {mode:04o}); make it private with `chmod 700 {path}` if nothing else needs it"
    if why:
        raise ConfigError(
            f"{setting} {path} {why}. The KV cache holds prompt contents, so it must live in a folder only "
            "this user can read: point it at a new folder (created 0700) or a private one.",
            param=setting,
        )
