"""SSDStore's upkeep (one of its base classes): reconciling the index with the files at startup,
TTL pruning, full verification, the admin flush, batched index writes, stats and the integrity
check. Pinned blocks are never removed here."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .format import atomic_write, block_files, read_block_file
from .index import INDEX_NAME, BlockIndex, reconcile
from .table_check import TableExpectation, table_checker

log = logging.getLogger(__name__)


class ValidationReport(NamedTuple):
    kept: int
    dropped_missing: int  # index entries whose file was gone
    adopted: int  # valid files the index did not know
    deleted_invalid: int  # damaged, foreign or misnamed files
    deleted_temp: int  # leftovers of interrupted writes
    evicted: int  # removed to fit the disk budget
    elapsed_s: float


class StoreUpkeep:
    """The upkeep half of SSDStore, which sets these fields and provides `_path`, `_remove`,
    `_evict_to_fit`, `_secondary_bytes` and `_drop_unreadable`."""

    cache_dir: Path
    namespace: bytes
    key: bytes
    table_rules: TableExpectation | None
    max_bytes: int
    ttl_s: float
    is_owner: bool
    _flush_lock: threading.Lock  # serializes index writes; taken before _lock, never inside it
    _lock: threading.Lock  # guards _index, _noncacheable, _stats, _dirty, _last_flush
    _index: BlockIndex
    _noncacheable: dict[bytes, float]
    _stats: dict[str, int]
    _dirty: bool
    _last_flush: float
    _clock: Callable[[], float]
    _is_pinned: Callable[[bytes], bool]

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
        report = ValidationReport(**counts, evicted=evicted, elapsed_s=round(time.perf_counter() - start, 4))
        log.debug("SSD index validated: %s", report._asdict())  # the server logs its own readable line
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

    def verify_all(self, on_block: Callable[[], None] | None = None) -> int:
        """Read and verify every block file (table and keyed checksum included); delete the damaged ones.
        Returns how many were deleted. Slow: for `mlx-kvserve cache verify`, not the hot path.
        `on_block` is called after each block (its progress bar)."""
        with self._lock:
            entries = list(self._index.items())
        damaged = 0
        for block_hash, entry in entries:
            if on_block is not None:
                on_block()
            try:
                path = self._path(block_hash)
                read_block_file(path, self.namespace, block_hash, key=self.key, check=table_checker(self.table_rules))
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
