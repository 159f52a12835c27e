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
- Thread-safe: one lock guards the index; array serialization and fsync happen outside it.
  Arrays passed to `save_block` must already be evaluated (`mx.eval`), so a writer thread only
  copies bytes and never runs MLX computations.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import NamedTuple, Protocol

import mlx.core as mx

from ..checked_json import DamagedFile, load_json, read_json
from . import ssd_index
from .fsmode import private_mkdir
from .ssd_index import (
    INDEX_NAME,
    INDEX_SCHEMA,
    MAX_INDEX_BYTES,
    TEMP_SUFFIX,
    BlockHeader,
    BlockIndex,
    FormatError,
    IndexEntry,
    atomic_write,
    block_files,
    block_relpath,
    fsync_dir,
    open_block_file,
    read_block_file,
    read_header,
    reconcile,
    tokens_digest,
    verify_block,
    write_block_file,
)

log = logging.getLogger(__name__)

COLLISION_ISOLATION_S = 3600.0
DEFAULT_TTL_S = 7 * 86400.0
# Block files read together by load_blocks: mlx reads them in parallel (cold, 8 at once read ~10%
# faster than one by one here: scripts/bench_ssd_io.py); 8 Llama-3-8B blocks are 64 MiB.
LOAD_WINDOW = 8


class PendingLoad(NamedTuple):
    """Block files being read (SSDStore.begin_load): their expected token ids and, for each,
    (hash, index entry, header, arrays not yet read)."""

    expected: tuple[tuple[int, ...], ...]
    opened: list[tuple]


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


class LoadedBlock(NamedTuple):
    token_ids: tuple[int, ...]
    arrays: dict[str, mx.array]
    parent_hash: bytes


class ValidationReport(NamedTuple):
    kept: int
    dropped_missing: int  # index entries whose file was gone
    adopted: int  # valid files the index did not know
    deleted_invalid: int  # damaged, foreign or misnamed files
    deleted_temp: int  # leftovers of interrupted writes
    evicted: int  # removed to fit the disk budget
    elapsed_s: float


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


class SSDStore:
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
    ):
        """`max_bytes` <= 0: no disk budget; `ttl_s` <= 0: no pruning. `is_pinned` is called under
        the store's lock, so it must be cheap and must not call the store. Raises OSError when the
        folder cannot be created; a missing or damaged index starts empty (validate_index adopts files)."""
        self.cache_dir = Path(cache_dir)
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.ttl_s = ttl_s
        self.is_owner = is_owner  # False: a guest in another server's folder (deletes and bookkeeping are the owner's)
        self._clock = clock
        self._is_pinned = is_pinned or (lambda _hash: False)
        self._secondary: SecondaryFiles | None = None  # set once by attach_secondary
        self._free_bytes = free_bytes
        self._temp_ids = itertools.count()
        private_mkdir(self.cache_dir)
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

    def save_blocks(self, blocks: Sequence[BlockToSave]) -> list[SaveResult]:
        """Persist several blocks (those not there already) with one durability step for all: each
        new block's temp file is written and its writeback started, then the files are fsync'd back
        to back, renamed into place and indexed, and each folder is fsync'd once. A block enters the
        index only after its file is durable; a crash before leaves temp files, which validate_index
        deletes. One result per block, in order. Never raises."""
        results: list[SaveResult] = []
        written: list[tuple[int, Path, IndexEntry]] = []  # (position, temp file, entry) awaiting fsync
        for block in blocks:
            verdict, tmp, entry = self._write_unsynced(block)
            if tmp is not None:
                written.append((len(results), tmp, entry))
            results.append(verdict)
        durable = []
        for position, tmp, entry in written:
            try:
                ssd_index.fsync_path(tmp)
                durable.append((position, tmp, entry))
            except Exception as exc:  # the OS reports a failed flush (a full disk) here
                results[position] = self._write_failed(blocks[position].block_hash, exc, tmp)
        folders = set()
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
        with self._lock:
            if self._evict_to_fit(num_bytes) is None:
                return SaveResult.SKIPPED
        return None

    def used_bytes(self) -> int:
        """Bytes of the block files plus any secondary files."""
        with self._lock:
            return self._index.used_bytes + self._secondary_bytes()

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
        return tmp, write_block_file(tmp, self.namespace, header, arrays, sync=sync)

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

    # --- load ----------------------------------------------------------------------------------

    def is_pinned(self, block_hash: bytes) -> bool:
        return self._is_pinned(block_hash)

    def recent_hashes(self) -> list[bytes]:
        """Every stored hash, most recently used first (a snapshot)."""
        with self._lock:
            return [h for h, _ in self._index.items()][::-1]

    def contains(self, block_hash: bytes) -> bool:
        """Whether the index lists this hash, or a file another server of this folder wrote holds
        it (adopted: see _adopt). The file is verified only by load_block."""
        with self._lock:
            if block_hash in self._index:
                return True
        return self._adopt(block_hash) is not None

    def _adopt(self, block_hash: bytes) -> IndexEntry | None:
        """Index a block file that is not in the index yet: another server sharing the folder wrote
        it since this one read the folder. Its header must name this namespace and hash; the rest
        is verified when it is loaded. None when there is no such file (the common miss: one stat)."""
        path = self._path(block_hash)
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):
                return None
            header = read_header(path, self.namespace)
            if header.block_hash != block_hash:
                return None
        except (OSError, ValueError):  # FormatError is a ValueError
            return None
        ids = header.token_ids
        entry = IndexEntry(len(ids), tokens_digest(ids), self._clock(), st.st_size)
        with self._lock:
            if block_hash in self._index:
                return self._index.get(block_hash)
            self._index.add(block_hash, entry)
            self._dirty = True
            self._stats["adopted"] += 1
        return entry

    def load_block(self, block_hash: bytes, expected_tokens: Sequence[int]) -> LoadedBlock | None:
        """The block's arrays if its file verifies and holds exactly `expected_tokens`, else None
        (a miss). Damaged files are deleted; other tokens under the hash count as a collision."""
        loaded = self.load_blocks([(block_hash, expected_tokens)])
        return loaded[0] if loaded else None

    def load_blocks(self, wanted: Sequence[tuple[bytes, Sequence[int]]]) -> list[LoadedBlock]:
        """The blocks of `wanted` (hash, expected tokens), in order, up to the first that misses:
        `load_block` for each, but the files of up to LOAD_WINDOW blocks are read together (mlx
        issues their reads in parallel; one Python thread still owns mlx)."""
        out: list[LoadedBlock] = []
        for start in range(0, len(wanted), LOAD_WINDOW):
            window = wanted[start : start + LOAD_WINDOW]
            got = self.end_load(self.begin_load(window))
            out += got
            if len(got) < len(window):
                break
        return out

    def begin_load(self, wanted: Sequence[tuple[bytes, Sequence[int]]]) -> PendingLoad:
        """Start reading the files of `wanted` (hash, expected tokens) up to the first that is not
        indexed or whose header does not check, and return at once: mlx reads them on its own
        threads while the caller computes. `end_load` waits, verifies and returns them."""
        opened = self._open_window(wanted)
        if opened:
            mx.async_eval([arrays for _, _, _, arrays in opened])
        return PendingLoad(tuple(tuple(ids) for _, ids in wanted[: len(opened)]), opened)

    def end_load(self, pending: PendingLoad) -> list[LoadedBlock]:
        """The blocks of a `begin_load`, in order, up to the first that fails verification."""
        opened = pending.opened
        if opened:
            try:
                mx.eval([arrays for _, _, _, arrays in opened])
            except Exception:  # one damaged file fails the whole read: read them one by one
                opened = self._read_one_by_one(opened)
        out: list[LoadedBlock] = []
        for (block_hash, entry, header, arrays), expected in zip(opened, pending.expected, strict=False):
            loaded = self._accept(block_hash, entry, header, arrays, expected)
            if loaded is None:
                break
            out.append(loaded)
        return out

    def _read_one_by_one(self, opened: list[tuple]) -> list[tuple]:
        """The opened blocks before the first whose file cannot be read (that one is dealt with)."""
        for i, (block_hash, entry, _, arrays) in enumerate(opened):
            try:
                mx.eval(arrays)
            except Exception as exc:  # mlx raises RuntimeError for unreadable or truncated files
                self._drop_unreadable(block_hash, entry, exc)
                return opened[:i]
        return opened

    def _open_window(self, window: Sequence[tuple[bytes, Sequence[int]]]) -> list[tuple]:
        """(hash, entry, header, lazy arrays) of the window's blocks up to the first that is not
        indexed or whose header does not check."""
        opened = []
        for block_hash, _ in window:
            with self._lock:
                entry = self._index.get(block_hash)
            if entry is None:
                entry = self._adopt(block_hash)
            if entry is None:
                with self._lock:
                    self._stats["misses"] += 1
                break
            try:
                header, arrays = open_block_file(self._path(block_hash), self.namespace, block_hash)
            except Exception as exc:  # mlx raises RuntimeError for unreadable or truncated files
                self._drop_unreadable(block_hash, entry, exc)
                break
            opened.append((block_hash, entry, header, arrays))
        return opened

    def _accept(
        self, block_hash: bytes, entry: IndexEntry, header: BlockHeader, arrays: dict, expected: tuple[int, ...]
    ) -> LoadedBlock | None:
        """A read block if its checksum and token ids hold, else None (and the file is dealt with)."""
        try:
            verify_block(self.namespace, header, arrays)
        except FormatError as exc:
            self._drop_unreadable(block_hash, entry, exc)
            return None
        with self._lock:
            if header.token_ids != expected:
                self._isolate(block_hash)
                self._stats["misses"] += 1
                return None
            if self._index.get(block_hash) is entry:
                self._index.touch(block_hash, self._clock())
                self._dirty = True
            self._stats["hits"] += 1
        return LoadedBlock(header.token_ids, arrays, header.parent_hash)

    def _drop_unreadable(self, block_hash: bytes, entry: IndexEntry, exc: Exception) -> None:
        with self._lock:
            self._stats["misses"] += 1
            if self._index.get(block_hash) is not entry:
                return  # replaced or removed meanwhile: not ours to judge
            if not self._path(block_hash).exists():
                self._stats["stale_cleaned"] += 1
                self._index.remove(block_hash)
                self._dirty = True
                return
            self._stats["corrupt"] += 1
            log.warning("SSD block %s unusable (%s); deleted", block_hash.hex()[:16], exc)
            self._remove(block_hash)

    # --- upkeep --------------------------------------------------------------------------------

    def validate_index(self, check_headers: bool = True, others_write: bool = False) -> ValidationReport:
        """Reconcile the index with the files; run at startup, before any writer starts (it deletes
        temp files). Drops entries without a file, adopts valid unindexed files, deletes damaged,
        foreign, misnamed and temp files, then fits the disk budget. `check_headers=False` trusts
        the headers of files the index already lists."""
        start = time.perf_counter()
        with self._lock:
            counts = reconcile(self._index, self.cache_dir, self.namespace, check_headers, self.is_owner, others_write)
            evicted = self._evict_to_fit(0, partial=True) or 0
            self._dirty = True  # sizes, adoptions and order may have changed; one write at startup
        report = ValidationReport(**counts, evicted=evicted, elapsed_s=time.perf_counter() - start)
        log.info("SSD index validated: %s", report._asdict())
        return report

    def prune_expired(self, now: float | None = None) -> int:
        """Delete unpinned blocks not accessed within ttl_s of `now` (default: the clock). Returns the count."""
        if self.ttl_s <= 0 or not self.is_owner:
            return 0
        with self._lock:
            now = self._clock() if now is None else now
            expired = [
                h for h, e in self._index.items() if e.last_accessed < now - self.ttl_s and not self._is_pinned(h)
            ]
            for block_hash in expired:
                self._remove(block_hash)
            self._stats["pruned"] += len(expired)
            self._noncacheable = {h: until for h, until in self._noncacheable.items() if until > now}
        if expired:
            log.info("SSD pruned %d blocks unused for %.0f s", len(expired), self.ttl_s)
        return len(expired)

    def verify_all(self) -> int:
        """Read and verify every block file (checksum included); delete the damaged ones.
        Returns how many were deleted. Slow: for `mlx-kvserve cache verify`, not the hot path."""
        with self._lock:
            entries = list(self._index.items())
        damaged = 0
        for block_hash, entry in entries:
            try:
                read_block_file(self._path(block_hash), self.namespace, block_hash)
            except Exception as exc:  # mlx raises RuntimeError for unreadable files
                self._drop_unreadable(block_hash, entry, exc)
                damaged += 1
        return damaged

    def remove_unpinned(self) -> int:
        """Delete every block that is not pinned (the admin flush). Returns the count."""
        with self._lock:
            doomed = [h for h, _ in self._index.items() if not self._is_pinned(h)]
            for block_hash in doomed:
                self._remove(block_hash)
            self._stats["flushed"] += len(doomed)
        return len(doomed)

    def flush(self) -> bool:
        """Write the index if it changed since the last write. Returns False if the write failed
        (the index stays dirty and is retried by the next flush); never raises."""
        with self._flush_lock:
            with self._lock:
                if not self.is_owner:  # the owner's index.json; a guest keeps its view in memory
                    self._dirty = False
                if not self._dirty:
                    return True
                snapshot = self._index.snapshot()
                self._dirty = False
                self._last_flush = self._clock()
            try:
                atomic_write(self.cache_dir / INDEX_NAME, BlockIndex.to_json(snapshot, self.namespace))
                return True
            except OSError as exc:
                log.warning("SSD index write failed: %s", exc)
                with self._lock:
                    self._dirty = True
                return False

    def maybe_flush(self, interval_s: float) -> bool:
        """flush() if at least `interval_s` passed since the last one; batches index writes."""
        with self._lock:
            due = self._dirty and self._clock() - self._last_flush >= interval_s
        return self.flush() if due else True

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"ssd_{k}": v for k, v in self._stats.items()}
            now = self._clock()
            out["ssd_isolated"] = sum(1 for until in self._noncacheable.values() if until > now)
            out["ssd_bytes"] = self._index.used_bytes
            out["ssd_blocks"] = len(self._index)
            out["ssd_max_bytes"] = self.max_bytes
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless the index matches the files and the byte total adds up.
        Call when idle (no save in progress)."""
        with self._lock:
            entries = list(self._index.items())
            assert sum(e.size for _, e in entries) == self._index.used_bytes, "ssd bytes do not add up"
            for block_hash, entry in entries:
                path = self._path(block_hash)
                assert path.is_file(), f"indexed block {block_hash.hex()[:16]} has no file"
                assert path.stat().st_size == entry.size, f"size of {block_hash.hex()[:16]} differs from the index"
            on_disk = {h for _, h in block_files(self.cache_dir) if h is not None}
            if self.is_owner:  # a guest's view may lag behind the blocks others add
                assert on_disk == {h for h, _ in entries}, "block files and index differ"
            if 0 < self.max_bytes < self._index.used_bytes + self._secondary_bytes(fresh=True):
                assert all(self._is_pinned(h) for h, _ in entries), "over budget while unpinned blocks remain"
                assert not self._secondary_bytes(), "over budget while tails remain"
