"""The SSD store's index: hash -> entry (token count and digest, last use, file size) in LRU order,
persisted as `index.json` in batches, and reconciled with the block files at startup.

The index is a cache of file headers plus access times: a block file alone is enough to rebuild its
entry (format.py), so a missing or damaged index costs only LRU/TTL history, because
`SSDStore.validate_index` adopts the files again (`reconcile`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from ...chain import HASH_BYTES
from ...checked_json import Const, Float, Hex, Int, MapOf, Obj, parse_json, read_json
from .format import TEMP_SUFFIX, FormatError, block_files, read_header, read_metadata

log = logging.getLogger(__name__)

INDEX_VERSION = 1
INDEX_NAME = "index.json"
MAX_INDEX_BYTES = 512 * 1024 * 1024  # ~3 million entries; a larger file is treated as damaged
INDEX_ENTRY_SCHEMA = Obj(
    {
        "num_tokens": Int(0, 2**31 - 1),
        "tokens_digest": Hex(16),
        "last_accessed": Float(0.0),
        "size": Int(0, 2**62),
    }
)
INDEX_SCHEMA = Obj(
    {
        "version": Const(INDEX_VERSION),
        "namespace": Hex(HASH_BYTES),
        "entries": MapOf(Hex(HASH_BYTES), INDEX_ENTRY_SCHEMA, max_items=10_000_000),
    }
)


def tokens_digest(token_ids: Sequence[int]) -> str:
    """A short digest of the token ids, kept in the index to tell a dedup from a collision."""
    return blake3(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()[:32]


def folder_namespace(folder: Path) -> bytes | None:
    """The namespace a store folder holds: from its index, else (a crash before the first index
    write, or a damaged index) from the first block file whose header names a namespace that
    matches the folder's name. None when neither says."""
    try:
        doc = read_json(folder / INDEX_NAME, Obj({"namespace": Hex(HASH_BYTES)}), MAX_INDEX_BYTES)
        namespace = bytes.fromhex(doc["namespace"])
        if namespace.hex().startswith(folder.name):
            return namespace
    except (OSError, ValueError):  # the store sets a damaged index aside when it opens the folder
        pass
    for path, block_hash in block_files(folder):
        if block_hash is None:
            continue
        try:
            namespace = bytes.fromhex(read_metadata(path).get("namespace", ""))
        except (OSError, ValueError):
            continue
        if len(namespace) == HASH_BYTES and namespace.hex().startswith(folder.name):
            return namespace
    return None


@dataclass
class IndexEntry:
    """What the store knows about one block file without opening it. The path derives from the hash."""

    num_tokens: int
    tokens_digest: str
    last_accessed: float  # wall-clock seconds (the store's clock)
    size: int  # file bytes


class BlockIndex:
    """hash -> IndexEntry in LRU order (least recently used first) with the byte total.
    Not thread-safe: SSDStore's lock guards it."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def items(self) -> Iterator[tuple[bytes, IndexEntry]]:
        """A snapshot in LRU order, safe to iterate while removing."""
        return iter(list(self._entries.items()))

    def get(self, block_hash: bytes) -> IndexEntry | None:
        return self._entries.get(block_hash)

    def add(self, block_hash: bytes, entry: IndexEntry) -> None:
        self.remove(block_hash)
        self._entries[block_hash] = entry
        self.used_bytes += entry.size

    def remove(self, block_hash: bytes) -> IndexEntry | None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.used_bytes -= entry.size
        return entry

    def touch(self, block_hash: bytes, now: float) -> None:
        self._entries[block_hash].last_accessed = now
        self._entries.move_to_end(block_hash)

    def resize(self, block_hash: bytes, size: int) -> None:
        entry = self._entries[block_hash]
        self.used_bytes += size - entry.size
        entry.size = size

    def sort_by_access(self) -> None:
        """Restore LRU order from last_accessed (after loading or adopting entries)."""
        ordered = sorted(self._entries.items(), key=lambda kv: kv[1].last_accessed)
        self._entries = OrderedDict(ordered)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """A copy of the entries for to_json, cheap enough to take under the store's lock."""
        return {h.hex(): dict(vars(e)) for h, e in self._entries.items()}

    @staticmethod
    def to_json(snapshot: dict[str, dict[str, Any]], namespace: bytes) -> bytes:
        return json.dumps({"version": INDEX_VERSION, "namespace": namespace.hex(), "entries": snapshot}).encode()

    @classmethod
    def from_json(cls, data: bytes, namespace: bytes, now: float | None = None) -> BlockIndex:
        """Raises ValueError (checked_json.DamagedFileError) for a damaged index or one written for
        another namespace or version."""
        return cls.from_doc(parse_json(data, INDEX_SCHEMA), namespace, now)

    @classmethod
    def from_doc(cls, doc: dict[str, Any], namespace: bytes, now: float | None = None) -> BlockIndex:
        """The index from a document that passed INDEX_SCHEMA. An access time after `now` (when
        given) reads as `now`: a block "used in the future" would outlive the TTL and the LRU.
        Raises ValueError when it was written for another namespace."""
        if doc["namespace"] != namespace.hex():
            raise ValueError("index of another namespace")
        index = cls()
        for name, fields in doc["entries"].items():
            entry = IndexEntry(**fields)
            if now is not None:
                entry.last_accessed = min(entry.last_accessed, now)
            index.add(bytes.fromhex(name), entry)
        index.sort_by_access()
        return index


def reconcile(
    index: BlockIndex,
    cache_dir: Path,
    namespace: bytes,
    check_headers: bool,
    delete: bool = True,
    others_write: bool = False,
) -> dict[str, int]:
    """Make `index` match the block files: drop entries without a file, adopt valid unindexed
    files, delete invalid and temp files (unless not `delete`: a guest server only leaves them
    out). `others_write`: other servers share the folder, so a temp file whose writer is alive is
    a write in progress, kept. Returns counts: kept, dropped_missing, adopted, deleted_invalid,
    deleted_temp. Headers of indexed files are read only if `check_headers`."""
    counts = dict.fromkeys(("kept", "dropped_missing", "adopted", "deleted_invalid", "deleted_temp"), 0)
    unlink = _unlink if delete else (lambda _path: 0)
    for path in cache_dir.glob(f"{INDEX_NAME}.*.tmp"):
        counts["deleted_temp"] += unlink(path)
    seen: set[bytes] = set()
    for path, block_hash in block_files(cache_dir):
        if block_hash is None:
            if others_write and path.name.endswith(TEMP_SUFFIX) and _writer_alive(path.name):
                continue  # a server sharing the folder is writing it
            counts["deleted_temp" if path.name.endswith(TEMP_SUFFIX) else "deleted_invalid"] += unlink(path)
            continue
        outcome = _reconcile_file(index, path, block_hash, namespace, check_headers, unlink)
        counts[outcome] += 1
        if outcome != "deleted_invalid":
            seen.add(block_hash)
    for block_hash, _ in index.items():
        if block_hash not in seen:
            index.remove(block_hash)
            counts["dropped_missing"] += 1
    index.sort_by_access()
    return counts


def _reconcile_file(
    index: BlockIndex, path: Path, block_hash: bytes, namespace: bytes, check_headers: bool, unlink: Callable
) -> str:
    entry = index.get(block_hash)
    try:
        stat = path.stat()
        if check_headers or entry is None:
            header = read_header(path, namespace)
            if header.block_hash != block_hash:
                raise FormatError("file holds another block")
    except (OSError, FormatError) as exc:
        log.debug("SSD file %s invalid (%s); deleted", path.name, exc)  # the report counts them
        index.remove(block_hash)
        unlink(path)
        return "deleted_invalid"
    if entry is None:
        ids = header.token_ids
        index.add(block_hash, IndexEntry(len(ids), tokens_digest(ids), stat.st_mtime, stat.st_size))
        return "adopted"
    if check_headers:  # the file is the truth about its tokens
        entry.num_tokens, entry.tokens_digest = len(header.token_ids), tokens_digest(header.token_ids)
    if entry.size != stat.st_size:
        index.resize(block_hash, stat.st_size)
    return "kept"


def _writer_alive(temp_name: str) -> bool:
    """Whether the temp file's writer (`<hash>.<pid>-<n>.tmp…`) is another live process."""
    match = re.fullmatch(r"[0-9a-f]+\.(\d+)-\d+" + re.escape(TEMP_SUFFIX), temp_name)
    if match is None:
        return False
    pid = int(match.group(1))
    if pid == os.getpid() or not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except OSError:
        return 0
