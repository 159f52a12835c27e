"""SSDStore: the persistent tier. One safetensors file per block, an index persisted in batches.

Contract:
- `save_block` and `load_block` never raise: every failure is a typed result or a miss, counted.
- A file is served only when its format version, namespace, checksum and token ids all check out;
  anything else is a miss, and a damaged file is deleted so it is never read again.
- The store owns its folder: give each namespace its own (`store_dir`), since files of another
  namespace are deleted as invalid. Other servers of the same namespace may share it as guests
  (`is_owner=False`, see folder_lock): a guest reads and adds blocks but never deletes a file nor
  writes the index; every store adopts a block another one wrote when a lookup first asks for it.
- Pinned hashes (`is_pinned`) are never removed by the disk budget or TTL pruning.
- Several stores may share one disk budget (`budget`, e.g. kv/ssd/budget.py's SSDBudget across the
  models of one server): before a write would pass `max_bytes`, the store asks it for room, outside
  its own lock; the budget answers by setting caps with `trim_to` (its own and other stores').
- Thread-safe: one lock guards the index; array serialization and fsync happen outside it.
  Arrays passed to `save_block` must already be evaluated (`mx.eval`), so a writer thread only
  copies bytes and never runs MLX computations.

This module holds the store's state, its save path and its disk budget; the read path is in
reads.py, the upkeep (validation, pruning, index writes, stats) in upkeep.py: SSDStore's base classes.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import NamedTuple, Protocol

import mlx.core as mx

from ...checked_json import DamagedFile, load_json, read_json
from ...fsmode import private_mkdir
from . import format as ssd_format
from .folder_key import folder_key
from .format import TEMP_SUFFIX, BlockHeader, block_relpath, fsync_dir, write_block_file
from .index import INDEX_NAME, INDEX_SCHEMA, MAX_INDEX_BYTES, BlockIndex, IndexEntry, tokens_digest
from .reads import StoreReads
from .table_check import TableExpectation
from .upkeep import StoreUpkeep

log = logging.getLogger(__name__)

COLLISION_ISOLATION_S = 3600.0
DEFAULT_TTL_S = 7 * 86400.0


class SaveResult(str, Enum):
    SAVED = "saved"
    DEDUP = "dedup"  # already on disk with the same tokens; its last_accessed was refreshed
    COLLISION = "collision"  # the hash is stored with other tokens, or isolated after such a clash
    ERROR = "error"  # an I/O failure; nothing was left behind
    SKIPPED = "skipped"  # refused: free space below the floor, or no room within the disk budget


class BlockToSave(NamedTuple):
    """What save_blocks takes per block (the writer's WriteJob has the same first fields). The
    arrays must already be evaluated (mx.eval)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: Sequence[int]
    arrays: Mapping[str, mx.array]


class TrimResult(NamedTuple):
    """A store's bytes after `trim_to` (blocks plus secondary files), the pinned blocks' share of
    them (the floor no trim goes below), and how many files the trim removed."""

    used_bytes: int
    pinned_bytes: int
    evicted: int


class StoreBudget(Protocol):
    """A disk budget shared with other stores. `reserve` is called outside the store's lock when
    `num_bytes` more would pass the store's `max_bytes`; it may raise the store's cap (trimming other
    stores for it) or leave it (the store then evicts its own least recently used files)."""

    def reserve(self, store: SSDStore, num_bytes: int) -> None: ...


class SecondaryFiles(Protocol):
    """Files of another kind in the store's folder (tails) that count in its byte budget and take
    part in its LRU eviction. Called under the store's lock: must not call the store."""

    def used_bytes(self, fresh: bool = False) -> int: ...
    def files(self) -> list[tuple[float, int, Path]]: ...  # (last use, size, path), oldest first; refreshes used_bytes
    def delete(self, path: Path) -> int: ...  # bytes freed


def store_dir(root: Path, namespace: bytes) -> Path:
    """The folder for one namespace under the SSD cache root."""
    return root / namespace.hex()[:16]


def _free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path`, measured at its nearest existing folder (the
    store's folder may have been deleted while running: the next write recreates it)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return shutil.disk_usage(path).free


class SSDStore(StoreReads, StoreUpkeep):
    def __init__(
        self,
        cache_dir: Path,
        namespace: bytes,
        max_bytes: int = 0,
        min_free_bytes: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
        is_pinned: Callable[[bytes], bool] | None = None,
        free_bytes: Callable[[Path], int] = _free_bytes,
        is_owner: bool = True,
        table_rules: TableExpectation | None = None,
    ):
        """`max_bytes` <= 0: no disk budget; `ttl_s` <= 0: no pruning. `is_pinned` is called under
        the store's lock, so it must be cheap and must not call the store. `table_rules`: what a
        block's arrays may be (kv/table_rules.py), checked before a file is read; None checks the
        table's structure only. Raises OSError when the folder or its key (folder_key.py) cannot be
        made; a missing or damaged index starts empty (validate_index adopts files)."""
        self.cache_dir = Path(cache_dir)
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.ttl_s = ttl_s
        self.is_owner = is_owner  # False: a guest in another server's folder (deletes and bookkeeping are the owner's)
        self._clock = clock
        self._is_pinned = is_pinned or (lambda _hash: False)
        self._secondary: SecondaryFiles | None = None  # set once by attach_secondary
        self.budget: StoreBudget | None = None  # a disk budget shared with other stores (set by it)
        self._free_bytes = free_bytes
        self._temp_ids = itertools.count()
        private_mkdir(self.cache_dir)
        self.key = folder_key(self.cache_dir, may_replace=is_owner)
        self.table_rules = table_rules
        self._flush_lock = threading.Lock()  # serializes index writes; taken before _lock, never inside it
        self._lock = threading.Lock()  # guards _index, _noncacheable, _stats, _dirty, _last_flush and block files
        self.damaged_files: list[DamagedFile] = []  # bookkeeping files found damaged (and set aside) here
        self._index = self._read_index()
        self._noncacheable: dict[bytes, float] = {}  # hash -> end of its collision isolation
        self._dirty = False
        self._last_flush = clock()
        keys = ("saves", "dedup", "collisions", "errors", "skipped_low_space", "skipped_budget", "hits", "misses")
        self._stats = dict.fromkeys(keys + ("corrupt", "stale_cleaned", "evictions", "pruned", "flushed", "adopted"), 0)

    def _path(self, block_hash: bytes) -> Path:
        return self.cache_dir / block_relpath(block_hash)

    def _read_index(self) -> BlockIndex:
        """The persisted index, or an empty one when it is missing or damaged: a damaged index is
        set aside and listed in damaged_files (validate_index then adopts the block files). A guest
        only reads it: a damaged one is ignored, never moved."""
        if not self.is_owner:
            try:
                return BlockIndex.from_doc(
                    read_json(self.cache_dir / INDEX_NAME, INDEX_SCHEMA, MAX_INDEX_BYTES), self.namespace, self._clock()
                )
            except (OSError, ValueError):
                return BlockIndex()
        loaded = load_json(
            self.cache_dir / INDEX_NAME,
            INDEX_SCHEMA,
            MAX_INDEX_BYTES,
            "SSD index",
            build=lambda doc: BlockIndex.from_doc(doc, self.namespace, self._clock()),
        )
        if loaded.damaged is not None:
            self.damaged_files.append(loaded.damaged)
        return loaded.value if loaded.value is not None else BlockIndex()

    # --- save ----------------------------------------------------------------------------------

    def save_block(
        self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int], arrays: Mapping[str, mx.array]
    ) -> SaveResult:
        """Persist one block unless it is there already. Never raises."""
        return self.save_blocks([BlockToSave(block_hash, parent_hash, token_ids, arrays)])[0]

    def save_blocks(self, blocks: Sequence[BlockToSave], pause: Callable[[], None] | None = None) -> list[SaveResult]:
        """Persist several blocks (those not there already) with one durability step for all: each
        new block's temp file is written and its writeback started, then the files are fsync'd back
        to back, renamed into place and indexed, and each folder is fsync'd once. A block enters the
        index only after its file is durable; a crash before leaves temp files, which validate_index
        deletes. `pause` is called before each file is written (the writer waits there while a
        request prefills). One result per block, in order. Never raises."""
        results: list[SaveResult] = []
        written: list[tuple[int, Path, IndexEntry]] = []  # (position, temp file, entry) awaiting fsync
        for block in blocks:
            if pause is not None:
                pause()
            verdict, tmp, entry = self._write_unsynced(block)
            if tmp is not None:
                written.append((len(results), tmp, entry))
            results.append(verdict)
        durable = []
        for position, tmp, entry in written:
            try:
                ssd_format.fsync_path(tmp)
                durable.append((position, tmp, entry))
            except Exception as exc:  # the OS reports a failed flush (a full disk) here
                results[position] = self._write_failed(blocks[position].block_hash, exc, tmp)
        folders = set()
        self._ask_budget(sum(entry.size for _, _, entry in durable))
        with self._lock:
            for position, tmp, entry in durable:
                block_hash = blocks[position].block_hash
                verdict = self._admit(block_hash, entry.num_tokens, entry.tokens_digest)  # another thread may have won
                results[position] = verdict if verdict is not None else self._install(block_hash, entry, tmp)
        for position, tmp, _ in durable:
            if results[position] is SaveResult.SAVED:
                folders.add(tmp.parent)
            else:
                tmp.unlink(missing_ok=True)
        for folder in folders:
            fsync_dir(folder)
        return results

    def _write_unsynced(self, block: BlockToSave) -> tuple[SaveResult, Path | None, IndexEntry | None]:
        """Write one block's temp file without waiting for the disk: (SAVED, temp file, its entry),
        or (the verdict, None, None) when it is not to be written or the write failed."""
        ids = tuple(block.token_ids)
        digest = tokens_digest(ids)
        with self._lock:
            verdict = self._admit(block.block_hash, len(ids), digest)
        if verdict is not None:
            return verdict, None, None
        try:
            if not self.has_free_space(sum(a.nbytes for a in block.arrays.values())):
                with self._lock:
                    self._stats["skipped_low_space"] += 1
                return SaveResult.SKIPPED, None, None
            header = BlockHeader(block.block_hash, block.parent_hash, ids, "")
            tmp, size = self._write_temp(header, block.arrays, sync=False)
        except Exception as exc:  # mlx reports I/O failures as RuntimeError, the OS as OSError
            return self._write_failed(block.block_hash, exc), None, None
        return SaveResult.SAVED, tmp, IndexEntry(len(ids), digest, self._clock(), size)

    def _write_failed(self, block_hash: bytes, exc: Exception, tmp: Path | None = None) -> SaveResult:
        log.warning("SSD write of block %s failed: %s", block_hash.hex()[:16], exc)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._stats["errors"] += 1
        return SaveResult.ERROR

    def has_free_space(self, num_bytes: int) -> bool:
        """Whether writing `num_bytes` more keeps the disk's free space above min_free_bytes."""
        return self._free_bytes(self.cache_dir) - num_bytes >= self.min_free_bytes

    def attach_secondary(self, files: SecondaryFiles) -> None:
        """Count `files` (the tails) in the byte budget and evict them by LRU together with blocks."""
        self._secondary = files

    def make_room(self, num_bytes: int) -> SaveResult | None:
        """Before a secondary file of `num_bytes` is written into this folder: None when it may be
        (room made within max_bytes by evicting least recently used unpinned blocks and tails),
        else SKIPPED (free space below the floor, or no room; nothing removed)."""
        if not self.has_free_space(num_bytes):
            return SaveResult.SKIPPED
        self._ask_budget(num_bytes)
        with self._lock:
            if self._evict_to_fit(num_bytes) is None:
                return SaveResult.SKIPPED
        return None

    def used_bytes(self) -> int:
        """Bytes of the block files plus any secondary files."""
        with self._lock:
            return self._index.used_bytes + self._secondary_bytes()

    def _ask_budget(self, num_bytes: int) -> None:
        """When `num_bytes` more would pass max_bytes, ask the shared budget (if any) for room,
        outside _lock: it trims other stores through their `trim_to`, and this one's."""
        budget = self.budget
        if budget is None or num_bytes <= 0:
            return
        with self._lock:
            fits = self.max_bytes <= 0 or self._index.used_bytes + self._secondary_bytes() + num_bytes <= self.max_bytes
        if not fits:
            budget.reserve(self, num_bytes)

    def trim_to(self, max_bytes: int) -> TrimResult:
        """Make `max_bytes` this store's disk budget and remove least recently used unpinned blocks
        and tails until the folder fits it; pinned blocks stay, so it may not (then every unpinned
        file is gone). `max_bytes` <= 0 keeps nothing unpinned (0 is not "no budget" here). A guest
        removes nothing. Never raises."""
        with self._lock:
            self.max_bytes = max(1, max_bytes)
            evicted = self._evict_to_fit(0, partial=True) or 0
            return TrimResult(self._index.used_bytes + self._secondary_bytes(), self._pinned_bytes(), evicted)

    def usage(self) -> TrimResult:
        """Bytes used and pinned now (`evicted` 0): what a shared budget reads."""
        with self._lock:
            return TrimResult(self._index.used_bytes + self._secondary_bytes(), self._pinned_bytes(), 0)

    def _pinned_bytes(self) -> int:
        return sum(e.size for h, e in self._index.items() if self._is_pinned(h))

    def _secondary_bytes(self, fresh: bool = False) -> int:
        return self._secondary.used_bytes(fresh) if self._secondary is not None else 0

    def _admit(self, block_hash: bytes, num_tokens: int, digest: str) -> SaveResult | None:
        """The seed's dedup guard: None means "write it". Caller holds _lock."""
        until = self._noncacheable.get(block_hash)
        if until is not None:
            if self._clock() < until:
                return SaveResult.COLLISION
            del self._noncacheable[block_hash]
        entry = self._index.get(block_hash)
        if entry is None:
            return None
        if not self._path(block_hash).exists():
            self._index.remove(block_hash)
            self._dirty = True
            self._stats["stale_cleaned"] += 1
            log.warning("SSD index entry %s had no file; cleaned", block_hash.hex()[:16])
            return None
        if entry.num_tokens != num_tokens or entry.tokens_digest != digest:
            self._isolate(block_hash)
            return SaveResult.COLLISION
        self._index.touch(block_hash, self._clock())
        self._dirty = True
        self._stats["dedup"] += 1
        return SaveResult.DEDUP

    def _isolate(self, block_hash: bytes) -> None:
        """Make a colliding hash non-cacheable for an hour; count and warn once per isolation."""
        if self._noncacheable.get(block_hash, 0.0) > self._clock():
            return
        self._noncacheable[block_hash] = self._clock() + COLLISION_ISOLATION_S
        self._stats["collisions"] += 1
        log.warning("SSD block hash collision on %s: non-cacheable for an hour", block_hash.hex()[:16])

    def _write_temp(self, header: BlockHeader, arrays: Mapping[str, mx.array], sync: bool = True) -> tuple[Path, int]:
        """Write a temp file next to the final path, fsync'd unless not `sync`: (path, size). Raises
        on I/O failure."""
        final = self._path(header.block_hash)
        private_mkdir(final.parent)  # the namespace folder too, if someone removed it meanwhile
        tmp = final.with_name(f"{header.block_hash.hex()}.{os.getpid()}-{next(self._temp_ids)}{TEMP_SUFFIX}")
        return tmp, write_block_file(tmp, self.namespace, header, arrays, sync=sync, key=self.key)

    def _install(self, block_hash: bytes, entry: IndexEntry, tmp: Path) -> SaveResult:
        """Make room within the budget, rename the temp file into place, index it. Caller holds _lock."""
        if self._evict_to_fit(entry.size) is None:
            self._stats["skipped_budget"] += 1
            return SaveResult.SKIPPED
        try:
            os.replace(tmp, self._path(block_hash))
        except OSError as exc:
            log.warning("SSD rename of block %s failed: %s", block_hash.hex()[:16], exc)
            self._stats["errors"] += 1
            return SaveResult.ERROR
        self._index.add(block_hash, entry)
        self._dirty = True
        self._stats["saves"] += 1
        return SaveResult.SAVED

    def _evict_to_fit(self, incoming: int, partial: bool = False) -> int | None:
        """Remove least recently used unpinned blocks and tails until `incoming` more bytes fit the
        budget. Returns how many were removed. When they cannot fit, removes nothing and returns
        None, unless `partial`: then it removes every unpinned file it can. Caller holds _lock."""
        if self.max_bytes <= 0 or self._index.used_bytes + self._secondary_bytes() + incoming <= self.max_bytes:
            return 0
        if not self.is_owner:  # only the owner evicts: a guest over the budget adds nothing
            return 0 if partial else None
        # The running total of the secondary files may be stale: one listing makes it exact (and
        # refreshes it) before anything is removed.
        secondary = self._secondary.files() if self._secondary is not None else []
        need = self._index.used_bytes + sum(size for _, size, _ in secondary) + incoming - self.max_bytes
        if need <= 0:
            return 0
        candidates = [(e.last_accessed, h, e.size) for h, e in self._index.items() if not self._is_pinned(h)]
        candidates += [(used, path, size) for used, size, path in secondary]
        candidates.sort(key=lambda c: c[0])
        victims, freed = [], 0
        for _, victim, size in candidates:
            if freed >= need:
                break
            victims.append(victim)
            freed += size
        if freed < need and not partial:
            return None
        for victim in victims:
            if isinstance(victim, bytes):
                self._remove(victim)
            else:
                self._secondary.delete(victim)
        self._stats["evictions"] += len(victims)
        return len(victims)

    def _remove(self, block_hash: bytes) -> None:
        """Drop an entry and its file (a guest drops only its entry). Caller holds _lock."""
        self._index.remove(block_hash)
        self._dirty = True
        if not self.is_owner:
            return
        try:
            self._path(block_hash).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("SSD could not delete block %s: %s", block_hash.hex()[:16], exc)
