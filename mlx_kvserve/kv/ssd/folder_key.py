"""The secret that authenticates a store folder's block and tail files (format.py's keyed checksum).

32 random bytes in `<store folder>/block.key`, mode 0600, made by the first server (owner or guest)
that opens the folder. A file whose checksum was computed without this key (forged with the public
algorithm, copied from another folder, written before format 4) fails verification: it is a
damaged file, deleted and recomputed. Whoever can read the key can forge blocks: it guards against
writers that cannot read the folder's 0600 files, not against the user the server runs as.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from ...checked_json import set_aside
from ...fsmode import open_private
from ...safe_files import open_regular

log = logging.getLogger(__name__)

KEY_FILE = "block.key"
KEY_BYTES = 32  # blake3's key size


def folder_key(folder: Path, may_replace: bool = True) -> bytes:
    """The folder's key, made when there is none. A damaged key file (another size, not a regular
    file, readable or writable by others) is set aside and replaced when `may_replace` (the folder's
    owner), which makes every file written under the old key unreadable; a guest raises OSError
    instead. Raises OSError when the key can neither be read nor made."""
    path = Path(folder) / KEY_FILE
    for _ in range(3):  # a racer may make or replace it between our read and our link
        try:
            return _read_key(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if not may_replace:
                raise
            set_aside(path, str(exc), "block key")
        if _make_key(path):
            log.info("made a new block key at %s: files written under another key are recomputed", path)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = open_regular(path)  # a FIFO or a link there raises, never blocks
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise OSError(f"others may use it (mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise OSError(f"{len(key)} bytes, not {KEY_BYTES}")
    return key


def _make_key(path: Path) -> bool:
    """Write a new key beside `path` and link it into place unless a racer's is there: True when
    ours is the one in place. Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp) as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces: two servers making keys at once agree on one
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links (exFAT): a rename, unless one appeared
            if os.path.lexists(path):
                return False
            os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)
