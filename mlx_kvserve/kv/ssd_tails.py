"""Tails (partial last blocks) on the SSD, so the first request after a restart reuses every
token a RAM tail would have served, not only whole blocks.

One verified file per tail in `<store>/tails/<parent hash>/<tail key>.safetensors` (the block
file format: checksum, namespace, token ids). At most `per_parent` tails per parent, the oldest
replaced first; pruned with the blocks' TTL. Never raises: a failure is a miss, logged once.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from blake3 import blake3

from .ssd_index import BlockHeader, read_block_file, read_header, write_block_file
from .tails import common_prefix

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


class LoadedTail(NamedTuple):
    token_ids: tuple[int, ...]
    arrays: dict[str, Any]
    num_shared: int  # how many leading tokens the lookup can use


def tail_key(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    return blake3(b"tail" + parent_hash + np.asarray(token_ids, dtype="<u4").tobytes()).digest()


class SSDTailStore:
    def __init__(self, folder: Path, namespace: bytes, per_parent: int = 4):
        self.folder = folder
        self.namespace = namespace
        self.per_parent = per_parent
        self.stats = {"ssd_tail_saves": 0, "ssd_tail_hits": 0, "ssd_tail_errors": 0}

    def _dir(self, parent_hash: bytes) -> Path:
        return self.folder / parent_hash.hex()

    def save(self, parent_hash: bytes, token_ids: Sequence[int], arrays: Mapping[str, Any]) -> bool:
        """Persist one tail (atomically: temp file, fsync, rename). False when skipped or failed."""
        folder = self._dir(parent_hash)
        key = tail_key(parent_hash, token_ids)
        path = folder / f"{key.hex()}{SUFFIX}"
        if path.exists():
            return False
        tmp = folder / f".{key.hex()}.tmp{SUFFIX}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_block_file(tmp, self.namespace, BlockHeader(key, parent_hash, tuple(token_ids), ""), arrays)
            os.replace(tmp, path)
            siblings = sorted(folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
            for old in siblings[: max(0, len(siblings) - self.per_parent)]:
                old.unlink(missing_ok=True)
        except Exception as exc:  # a tail is a convenience: never fail a request for it
            tmp.unlink(missing_ok=True)
            self.stats["ssd_tail_errors"] += 1
            log.warning("could not save a tail under %s: %s", parent_hash.hex()[:16], exc)
            return False
        self.stats["ssd_tail_saves"] += 1
        return True

    def best(self, parent_hash: bytes, rest: Sequence[int]) -> LoadedTail | None:
        """The verified tail under `parent_hash` sharing the longest prefix with `rest`, or None.
        Damaged files are deleted."""
        folder = self._dir(parent_hash)
        if not rest or not folder.is_dir():
            return None
        best: tuple[int, Path, BlockHeader] | None = None
        for path in folder.glob(f"*{SUFFIX}"):
            if path.name.startswith("."):
                continue
            try:
                header = read_header(path, self.namespace)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            n = common_prefix(header.token_ids, rest)
            if n and (best is None or n > best[0]):
                best = (n, path, header)
        if best is None:
            return None
        n, path, header = best
        try:
            header, arrays = read_block_file(path, self.namespace, header.block_hash)
        except Exception as exc:  # mlx raises RuntimeError for unreadable files
            log.warning("tail file %s unusable (%s); deleted", path.name[:16], exc)
            path.unlink(missing_ok=True)
            self.stats["ssd_tail_errors"] += 1
            return None
        os.utime(path)  # recently used: kept longest by the per-parent limit and the TTL
        self.stats["ssd_tail_hits"] += 1
        return LoadedTail(header.token_ids, arrays, n)

    def prune(self, ttl_s: float, now: float | None = None) -> int:
        """Delete tails unused for `ttl_s` seconds; returns the count."""
        if ttl_s <= 0 or not self.folder.is_dir():
            return 0
        cutoff = (time.time() if now is None else now) - ttl_s
        removed = 0
        for path in self.folder.glob(f"*/*{SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except OSError:
                continue
        return removed

    def clear(self) -> int:
        """Delete every tail (the admin flush with ssd=true). Returns the count."""
        count = len(list(self.folder.glob(f"*/*{SUFFIX}"))) if self.folder.is_dir() else 0
        shutil.rmtree(self.folder, ignore_errors=True)
        return count
