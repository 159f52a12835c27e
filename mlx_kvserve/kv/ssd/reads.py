"""SSDStore's read path (one of its base classes): membership, adopting block files that another
server of the folder wrote, and verified loads, the files of a chain read together.

A file is served only when its header, array table (table_check.py: before its payload is read),
keyed checksum and token ids check out; a damaged or forged file is a miss and is deleted, other
tokens under the hash are a collision (the hash is isolated).

Two ways to read, the same checks: through mlx (`mx.load` of the payload, evaluated together so mlx
reads the files in parallel, then hashed where it lies on the pool's threads while mlx reads the
next window, the kernel reading the chain's later files ahead: readahead.py), or through host memory on a thread pool
(each file read and hashed in a numpy buffer, then one copy into an mlx array). The second is for a
CUDA device, where hashing an mlx array reads it back from the GPU: on an H200 the checksum took
3.1 ms per 8 MiB block that way against 0.8 ms on the host (docs/benchmarks-history-2026-12-07.md "GPU").
"""

from __future__ import annotations

import logging
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx

from ..base import RequestBuffers
from .format import (
    BlockHeader,
    FormatError,
    open_block_file,
    payload_arrays,
    payload_checksum,
    read_block_host,
    read_header,
)
from .index import BlockIndex, IndexEntry, tokens_digest
from .loaded import LoadedBlock, PendingLoad, reads_through_host
from .readahead import Readahead
from .run_loads import StoreRunReads
from .table_check import TableExpectation, table_checker

log = logging.getLogger(__name__)

# Block files read together by load_blocks: mlx reads them in parallel (cold, 8 at once read ~10%
# faster than one by one here: scripts/bench_ssd_io.py); 8 Llama-3-8B blocks are 64 MiB.
LOAD_WINDOW = 8


class StoreReads(StoreRunReads):
    """The read half of SSDStore, which sets these fields and provides `_path`, `_isolate` and
    `_remove` (called with `_lock` held)."""

    namespace: bytes
    key: bytes  # the folder's secret (folder_key.py): the checksums are keyed with it
    table_rules: TableExpectation | None  # what a table may hold (None: its structure only)
    _lock: threading.Lock  # guards _index, _stats, _dirty
    _index: BlockIndex
    _stats: dict[str, int]
    _dirty: bool
    _clock: Callable[[], float]
    _pool: ThreadPoolExecutor | None = None  # this store's reading threads (_read_pool)
    _pool_lock = threading.Lock()  # guards every store's _pool (held only to make or take one)
    _is_pinned: Callable[[bytes], bool]
    host_reads: bool | None = None  # None: reads_through_host(); tests set it to try either way

    def _read_pool(self) -> ThreadPoolExecutor:
        """This store's reading threads (made on first use; close_reads ends them). One pool a store, not
        one a process: a model's store closing never stops another model's reads, and a process's
        last stop (clean_exit.end_process waits for every non-daemon thread) finds none idling."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=LOAD_WINDOW, thread_name_prefix="ssd-read")
            return self._pool

    def close_reads(self) -> None:
        """End the reading threads (idempotent; a later read makes new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

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

    def load_blocks(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], into: RequestBuffers | None = None
    ) -> list[LoadedBlock]:
        """The blocks of `wanted` (hash, expected tokens), in order, up to the first that misses:
        `load_block` for each, but the files of up to LOAD_WINDOW blocks are read together (mlx
        issues their reads in parallel; one Python thread still owns mlx). The kernel reads the
        chain's files ahead (readahead.py) and the next window's reads start before this one is
        checked, so the disk streams while the checksums run. `into`: read into a request's own
        buffers where the chain is read as a run (run_loads.py)."""
        windows = [wanted[start : start + LOAD_WINDOW] for start in range(0, len(wanted), LOAD_WINDOW)]
        ahead = Readahead([self._path(block_hash) for block_hash, _ in wanted])
        out: list[LoadedBlock] = []
        try:
            layout = self._run_layout(wanted)
            if layout is not None:  # one read into a run, the kernel reading ahead of it
                return self._load_run(wanted, layout, ahead.consumed, into)
            pending = self.begin_load(windows[0]) if windows else None
            for i, window in enumerate(windows):
                whole = len(pending.opened) == len(window)
                following = self.begin_load(windows[i + 1]) if whole and i + 1 < len(windows) else None
                got = self.end_load(pending)
                out += got
                ahead.consumed(len(out))
                if len(got) < len(window) or following is None:
                    break
                pending = following
        finally:
            ahead.close()
        return out

    def begin_load(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], into: RequestBuffers | None = None
    ) -> PendingLoad:
        """Start reading the files of `wanted` (hash, expected tokens) up to the first that is not
        indexed or whose header does not check, and return at once: mlx reads them on its own
        threads while the caller computes. `end_load` waits, verifies and returns them. `into`: as
        for `load_blocks`."""
        layout = self._run_layout(wanted)
        if layout is not None:
            return self._begin_run_load(wanted, layout, into)
        opened = self._open_window(wanted)
        if opened and not isinstance(opened[0][3], Future):
            mx.async_eval([payload for _, _, _, payload in opened])
        return PendingLoad(tuple(tuple(ids) for _, ids in wanted[: len(opened)]), opened)

    def end_load(self, pending: PendingLoad) -> list[LoadedBlock]:
        """The blocks of a `begin_load`, in order, up to the first that fails verification."""
        opened = pending.opened
        if pending.run is not None:
            return self._collect_run([(h, e, f) for h, e, _, f in opened], pending.run)
        if opened and isinstance(opened[0][3], Future):
            return self._end_host_load(pending)
        if opened:
            try:
                mx.eval([payload for _, _, _, payload in opened])
            except Exception:  # one damaged file fails the whole read: read them one by one
                opened = self._read_one_by_one(opened)
        out: list[LoadedBlock] = []
        sums = self._checksums(opened)
        for (block_hash, entry, header, payload), expected, checksum in zip(
            opened, pending.expected, sums, strict=False
        ):
            if checksum != header.checksum:
                self._drop_unreadable(block_hash, entry, FormatError("checksum mismatch"))
                break
            loaded = self._accept(block_hash, entry, header, payload, expected)
            if loaded is None:
                break
            out.append(loaded)
        return out

    def _checksums(self, opened: list[tuple]) -> list[str]:
        """The keyed checksums of read payloads, hashed at once on the pool's threads (blake3 lets go of
        the GIL): the CPU's cores share the window's hashing while mlx reads the next one."""
        views = [memoryview(payload) for _, _, _, payload in opened]  # made here, on mlx's thread
        futures = [
            self._read_pool().submit(payload_checksum, self.namespace, header, view, key=self.key)
            for (_, _, header, _), view in zip(opened, views, strict=True)
        ]
        return [future.result() for future in futures]

    def _end_host_load(self, pending: PendingLoad) -> list[LoadedBlock]:
        out: list[LoadedBlock] = []
        for (block_hash, entry, _, future), expected in zip(pending.opened, pending.expected, strict=False):
            try:
                header, host_payload = future.result()
            except Exception as exc:  # FormatError (checksum included) or OSError
                self._drop_unreadable(block_hash, entry, exc)
                break
            loaded = self._accept(block_hash, entry, header, mx.array(host_payload), expected)
            if loaded is None:
                break
            out.append(loaded)
        return out

    def _read_one_by_one(self, opened: list[tuple]) -> list[tuple]:
        """The opened blocks before the first whose file cannot be read (that one is dealt with)."""
        for i, (block_hash, entry, _, payload) in enumerate(opened):
            try:
                mx.eval(payload)
            except Exception as exc:  # mlx raises RuntimeError for unreadable or truncated files
                self._drop_unreadable(block_hash, entry, exc)
                return opened[:i]
        return opened

    def _open_window(self, window: Sequence[tuple[bytes, Sequence[int]]]) -> list[tuple]:
        """(hash, entry, header, lazy payload) of the window's blocks up to the first that is not
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
            if self.host_reads if self.host_reads is not None else reads_through_host():
                path, check = self._path(block_hash), table_checker(self.table_rules)
                future = self._read_pool().submit(
                    read_block_host, path, self.namespace, block_hash, key=self.key, check=check
                )
                opened.append((block_hash, entry, None, future))
                continue
            try:
                header, payload = open_block_file(self._path(block_hash), self.namespace, block_hash)
                table_checker(self.table_rules)(header, payload.size)  # before anything is read
            except Exception as exc:  # mlx raises RuntimeError for unreadable or truncated files
                self._drop_unreadable(block_hash, entry, exc)
                break
            opened.append((block_hash, entry, header, payload))
        return opened

    def _accept(
        self, block_hash: bytes, entry: IndexEntry, header: BlockHeader, payload: mx.array, expected: tuple[int, ...]
    ) -> LoadedBlock | None:
        """A read block whose checksum held if its table and token ids hold, else None (and the file
        is dealt with)."""
        try:
            arrays = payload_arrays(header, payload)
        except Exception as exc:  # FormatError; anything else a file makes happen is damage too
            self._drop_unreadable(block_hash, entry, exc)
            return None
        if header.token_ids != expected:
            self._other_tokens(block_hash)
            return None
        self._count_hit(block_hash, entry)
        return LoadedBlock(header.token_ids, arrays, header.parent_hash)

    def _other_tokens(self, block_hash: bytes) -> None:
        """A verified file holds other token ids than the prompt's: a collision, the hash isolated."""
        with self._lock:
            self._isolate(block_hash)
            self._stats["misses"] += 1

    def _count_hit(self, block_hash: bytes, entry: IndexEntry) -> None:
        with self._lock:
            if self._index.get(block_hash) is entry:
                self._index.touch(block_hash, self._clock())
                self._dirty = True
            self._stats["hits"] += 1

    def discard(self, block_hash: bytes, exc: Exception) -> None:
        """A loaded block turned out unusable (its arrays do not make a payload): a damaged file,
        deleted and counted in `corrupt` like one that fails its checks."""
        with self._lock:
            entry = self._index.get(block_hash)
        if entry is not None:
            self._drop_unreadable(block_hash, entry, exc)

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
