"""Tails (partial last blocks) on the SSD, so the first request after a restart reuses every
token a RAM tail would have served, not only whole blocks.

One verified file per tail in `<store>/tails/<parent hash>/<tail key>.safetensors` (the block
file format: table, keyed checksum, namespace, token ids). A file's mtime is its tail's last use (saved, served
from the SSD, or served from RAM: `touch`), so the SSD keeps what RAM keeps: at most `per_parent`
tails per parent, the least recently used replaced first; pruned with the blocks' TTL. Never
raises: a failure is a miss, logged once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from stat import S_ISDIR
from typing import Any, NamedTuple

from ...chain import HASH_BYTES
from ...fsmode import private_mkdir
from ..tails import common_prefix
from .folder_key import folder_key
from .format import (
    BLOCK_SUFFIX,
    BlockHeader,
    check_identity,
    read_block_file,
    read_header,
    tail_key,
    write_block_file,
)
from .store import SaveResult
from .table_check import TableExpectation, table_checker

log = logging.getLogger(__name__)
SUFFIX = BLOCK_SUFFIX  # a tail file is a block file (format.py)


class TailReport(NamedTuple):
    kept: int
    deleted_invalid: int  # files failing a check, foreign names, links
    deleted_temp: int  # leftovers of interrupted saves


class LoadedTail(NamedTuple):
    token_ids: tuple[int, ...]
    arrays: dict[str, Any]
    num_shared: int  # how many leading tokens the lookup can use


class SSDTailStore:
    def __init__(
        self,
        folder: Path,
        namespace: bytes,
        per_parent: int = 4,
        exact: bool = False,
        may_delete: bool = True,
        key: bytes | None = None,
        table_rules: TableExpectation | None = None,
    ):
        """`may_delete` False: a guest server in another server's folder (folder_lock.py) adds
        tails but deletes none: the per-parent limit and damaged files are the owner's to act on.
        `key`: the store folder's (default: read from the folder above `folder`, when first
        needed); `table_rules` as SSDStore's."""
        self.folder = folder
        self._key = key
        self.table_rules = table_rules
        self.may_delete = may_delete
        self.namespace = namespace
        self.per_parent = per_parent
        self.exact = exact  # tails are usable only whole (they carry checkpoints): see TailStore
        keys = ("saves", "hits", "errors", "write_errors", "skipped_low_space", "skipped_budget", "evictions")
        self.stats = {f"ssd_tail_{k}": 0 for k in keys}
        # A running total between listings: deletions by other paths (damaged files, TTL) only make
        # it high, and the store's eviction lists the files (exact) before it removes anything.
        self._used_bytes = 0
        self.used_bytes(fresh=True)

    @property
    def key(self) -> bytes:
        """The store folder's key (folder_key.py). Raises OSError when it can be neither read nor made."""
        if self._key is None:
            self._key = folder_key(self.folder.parent, may_replace=self.may_delete)
        return self._key

    def _dir(self, parent_hash: bytes) -> Path:
        return self.folder / parent_hash.hex()

    def save(
        self, parent_hash: bytes, token_ids: Sequence[int], arrays: Mapping[str, Any], used_at: float | None = None
    ) -> SaveResult:
        """Persist one tail (atomically: temp file, fsync, rename): SAVED, DEDUP (already there: its
        last use is refreshed) or ERROR (counted in `ssd_tail_write_errors`; nothing left behind).
        `used_at`: when the tail was last used (registered, or served while queued), else now. The
        caller makes room within the byte budget and checks the free-space floor first
        (SSDStore.make_room)."""
        folder = self._dir(parent_hash)
        key = tail_key(parent_hash, token_ids)
        path = folder / f"{key.hex()}{SUFFIX}"
        if path.exists():
            self.touch(parent_hash, token_ids, used_at)
            return SaveResult.DEDUP
        tmp = folder / f".{key.hex()}.{os.getpid()}.tmp{SUFFIX}"  # one per process: servers may share the folder
        try:
            private_mkdir(folder)  # tails/ too, if someone removed it meanwhile
            if not (_real_dir(self.folder) and _real_dir(folder)):
                raise OSError(f"{folder} is not a plain folder (a link?); tails are never written through links")
            header = BlockHeader(key, parent_hash, tuple(token_ids), "")
            size = write_block_file(tmp, self.namespace, header, arrays, key=self.key)
            os.replace(tmp, path)
            if used_at is not None:  # a writer delay must not make it look newer than later uses
                os.utime(path, (used_at, used_at))
            self._used_bytes += size
            siblings = sorted(_tail_files(folder), key=lambda p: p.stat().st_mtime) if self.may_delete else []
            for old in siblings[: max(0, len(siblings) - self.per_parent)]:
                self._used_bytes = max(0, self._used_bytes - _unlink_size(old))
        except Exception as exc:  # a tail is a convenience: never fail a request for it
            with contextlib.suppress(OSError):  # the folder itself may be what failed
                tmp.unlink(missing_ok=True)
            self.stats["ssd_tail_errors"] += 1
            self.stats["ssd_tail_write_errors"] += 1
            log.warning("could not save a tail under %s: %s", parent_hash.hex()[:16], exc)
            return SaveResult.ERROR
        self.stats["ssd_tail_saves"] += 1
        return SaveResult.SAVED

    def touch(self, parent_hash: bytes, token_ids: Sequence[int], at: float | None = None) -> bool:
        """Record a use of the tail (served from RAM, produced again) at `at` (default now): its
        file's mtime, which orders the per-parent limit, the byte budget's LRU and the TTL. False
        when there is no such file (not written yet, evicted) or it is not in plain folders."""
        folder = self._dir(parent_hash)
        if not (_real_dir(self.folder) and _real_dir(folder)):
            return False
        path = folder / f"{tail_key(parent_hash, token_ids).hex()}{SUFFIX}"
        try:
            os.utime(path, None if at is None else (at, at), follow_symlinks=False)
        except OSError:
            return False
        return True

    def best(self, parent_hash: bytes, rest: Sequence[int]) -> LoadedTail | None:
        """The verified tail under `parent_hash` sharing the longest prefix with `rest`, or None.
        A tail is served only when its file passes `check_identity` for `parent_hash` (so a file
        copied in from another parent's folder never is) and its checksum verifies. A file that
        fails is a miss, deleted and counted in ssd_tail_errors."""
        if not rest or not _real_dir(self.folder):
            return None
        best: tuple[int, Path, BlockHeader] | None = None
        for path in _tail_files(self._dir(parent_hash)):
            try:
                header = read_header(path, self.namespace)
                check_identity(header, path, parent_hash)
            except (OSError, ValueError) as exc:
                self._discard(path, exc)
                continue
            n = common_prefix(header.token_ids, rest)
            if self.exact and n < len(header.token_ids):
                continue
            if n and (best is None or n > best[0]):
                best = (n, path, header)
        if best is None:
            return None
        n, path, header = best
        try:
            header, arrays = self._read(path, header.block_hash)
            check_identity(header, path, parent_hash)  # again: the file may have been replaced meanwhile
        except Exception as exc:  # mlx raises RuntimeError for unreadable files
            self._discard(path, exc)
            return None
        os.utime(path)  # recently used: kept longest by the per-parent limit and the TTL
        self.stats["ssd_tail_hits"] += 1
        return LoadedTail(header.token_ids, arrays, n)

    def _read(self, path: Path, key: bytes) -> tuple[BlockHeader, dict[str, Any]]:
        return read_block_file(path, self.namespace, key, key=self.key, check=table_checker(self.table_rules))

    def discard(self, parent_hash: bytes, token_ids: Sequence[int], exc: Exception) -> None:
        """A served tail turned out unusable (its arrays do not make a payload): deleted, counted."""
        self._discard(self._dir(parent_hash) / f"{tail_key(parent_hash, token_ids).hex()}{SUFFIX}", exc)

    def _discard(self, path: Path, exc: Exception) -> None:
        if not self.may_delete:
            log.warning("tail file %s unusable (%s); skipped (the folder's owner deletes it)", path.name[:16], exc)
            self.stats["ssd_tail_errors"] += 1
            return
        log.warning("tail file %s unusable (%s); deleted", path.name[:16], exc)
        self._used_bytes = max(0, self._used_bytes - _unlink_size(path))
        self.stats["ssd_tail_errors"] += 1

    def prune(self, ttl_s: float, now: float | None = None) -> int:
        """Delete tail files (and leftovers of interrupted saves) unused for `ttl_s` seconds;
        returns the count. Never follows a link out of the tails folder."""
        if ttl_s <= 0:
            return 0
        cutoff = (time.time() if now is None else now) - ttl_s
        removed = 0
        for folder in _parent_dirs(self.folder):
            for path in _plain_files(folder):
                try:
                    if path.lstat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
                except OSError:
                    continue
        self.used_bytes(fresh=True)
        return removed

    def clear(self) -> int:
        """Delete every tail (the admin flush with ssd=true). Returns the count."""
        count = sum(len(_tail_files(folder)) for folder in _parent_dirs(self.folder))
        _remove_any(self.folder)  # a link in its place is removed, never followed
        self.used_bytes(fresh=True)
        return count

    def verify_all(self) -> TailReport:
        """Offline (`cache verify`, while nothing else writes here): read every tail file in full;
        delete those failing the checks of `best`, leftovers of interrupted saves, anything else
        in the tails folder (links included, never followed) and empty parent folders."""
        if not os.path.lexists(self.folder):
            return TailReport(0, 0, 0)
        if not _real_dir(self.folder):
            return TailReport(0, _remove_any(self.folder), 0)
        kept = invalid = temp = 0
        for entry in _scandir(self.folder):
            path = Path(entry.path)
            parent = _hash_from_name(entry.name, "")
            if parent is None or not entry.is_dir(follow_symlinks=False):
                invalid += _remove_any(path)
                continue
            counts = self._verify_parent(path, parent)
            kept, invalid, temp = kept + counts.kept, invalid + counts.deleted_invalid, temp + counts.deleted_temp
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty
        self.used_bytes(fresh=True)
        return TailReport(kept, invalid, temp)

    def _verify_parent(self, folder: Path, parent_hash: bytes) -> TailReport:
        kept = invalid = temp = 0
        for entry in _scandir(folder):
            path = Path(entry.path)
            key = _hash_from_name(entry.name, SUFFIX)
            if not entry.is_file(follow_symlinks=False) or key is None:
                if _is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                    temp += _remove_any(path)
                else:
                    invalid += _remove_any(path)
                continue
            try:
                header, _ = self._read(path, key)
                check_identity(header, path, parent_hash)
                kept += 1
            except Exception as exc:  # mlx raises RuntimeError for unreadable files
                log.info("tail file %s/%s invalid (%s); deleted", folder.name[:16], entry.name[:16], exc)
                invalid += _remove_any(path)
        return TailReport(kept, invalid, temp)

    # --- byte accounting: tails count in the SSD tier's budget like blocks -----------------------

    def used_bytes(self, fresh: bool = False) -> int:
        """Bytes of the tail files; `fresh` rescans the folder (exact) instead of the running total."""
        if fresh:
            self.files()
        return self._used_bytes

    def files(self) -> list[tuple[float, int, Path]]:
        """(last use as mtime, size, path) of every tail file, least recently used first. The
        listing also makes the running byte total exact."""
        out = []
        for folder in _parent_dirs(self.folder):  # never through links: eviction deletes what it lists
            for path in _tail_files(folder):
                try:
                    stat = path.stat()
                except OSError:
                    continue
                out.append((stat.st_mtime, stat.st_size, path))
        self._used_bytes = sum(size for _, size, _ in out)
        return sorted(out)

    def delete(self, path: Path) -> int:
        """Delete one tail file to make room (the store's LRU eviction). Returns the bytes freed."""
        size = _unlink_size(path)
        self._used_bytes = max(0, self._used_bytes - size)
        self.stats["ssd_tail_evictions"] += 1 if size else 0
        return size


# --- the tails folder, walked without following links (they could point out of the cache) ------


def _scandir(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError:
        return []


def _real_dir(path: Path) -> bool:
    try:
        return S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _parent_dirs(tails: Path) -> list[Path]:
    """The per-parent folders (real ones, not links) in the tails folder."""
    if not _real_dir(tails):
        return []
    return [Path(e.path) for e in _scandir(tails) if e.is_dir(follow_symlinks=False)]


def _plain_files(folder: Path) -> list[Path]:
    if not _real_dir(folder):
        return []
    return [Path(e.path) for e in _scandir(folder) if e.is_file(follow_symlinks=False)]


def _tail_files(folder: Path) -> list[Path]:
    """The tail files in a per-parent folder: plain files with a tail key's name (saves in
    progress, `.<key>.tmp.safetensors`, and anything else are left out)."""
    return [p for p in _plain_files(folder) if _hash_from_name(p.name, SUFFIX) is not None]


def _hash_from_name(name: str, suffix: str) -> bytes | None:
    """The hash a canonical name `<64 lowercase hex><suffix>` stands for, else None."""
    stem = name.removesuffix(suffix) if suffix else name
    if (suffix and stem == name) or not re.fullmatch(f"[0-9a-f]{{{2 * HASH_BYTES}}}", stem):
        return None
    return bytes.fromhex(stem)


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(f".tmp{SUFFIX}")


def _remove_any(path: Path) -> int:
    """Delete a file, link or folder (a link itself, never its target); 1 when done, else 0."""
    try:
        if _real_dir(path):
            shutil.rmtree(path)
        else:
            path.unlink()
        return 1
    except OSError:
        return 0


def _unlink_size(path: Path) -> int:
    """Delete `path`; its size in bytes, or 0 when it was already gone or cannot be deleted."""
    try:
        size = path.stat().st_size
        path.unlink()
        return size
    except OSError:
        return 0
