"""The store's run reads (a base class of StoreReads, reads.py): a chain's block files read into one
buffer per full-attention array (run_reads.py), verified file by file, handed back as one run.

Two ways in, the same checks and the same outcomes as the per-block read (a damaged, forged or
foreign-table file deleted and counted, other token ids a collision, the chain ending there):
- `_load_run` (a restore read now: `load_blocks`): mlx reads the files, a window of 8 at a time in
  parallel (as fast as the per-block read: mlx's own readers keep the disk's queue full), while
  the reading threads verify and place the windows it read before (each payload's keyed checksum,
  then its arrays copied into the run) and the payloads go back to mlx's buffer cache;
- `_begin_run_load` / `_collect_run` (`begin_load` / `end_load`, a read started while the engine
  computes): the reading threads read the files themselves (run_reads.read_into_run), so that
  nothing waits on mlx's thread; also the way on CUDA, where arrays live apart from the CPU.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import mlx.core as mx

from ..base import RequestBuffers
from .index import IndexEntry
from .loaded import LoadedBlock, LoadedRun, PendingLoad, reads_through_host
from .run_reads import RunBuffers, RunLayout, read_into_run, rest_arrays, run_layout, verify_into_run
from .table_check import TableExpectation

log = logging.getLogger(__name__)

WINDOW = 8  # files mlx reads together (reads.LOAD_WINDOW)
WINDOWS_AHEAD = 2  # windows read but not yet placed, at most: the payloads held beside the run
# A run's array at most this big (bigger chains: a run per so many blocks, each joined once): glibc maps
# a larger allocation apart and unmaps it when freed, so each restore would start on fresh pages (on the
# CPU, 1 s of page faults for a 16k-token Llama-3-8B prefix here); the heap keeps smaller ones for the
# next (cpu/warm_memory.py: the mmap threshold's largest value).
RUN_BYTES = 32 * 2**20


class StoreRunReads:
    """Run reads for SSDStore; StoreReads provides the rest (`_open_window`, `_read_one_by_one`,
    `_adopt`, `_drop_unreadable`, `_other_tokens`, `_count_hit`, `_read_pool`, `_path`)."""

    table_rules: TableExpectation | None
    host_reads: bool | None
    run_reads = True  # a chain's files read into a run; False: one array per file (the per-block read)

    def _run_layout(self, wanted: Sequence[tuple[bytes, Sequence[int]]]) -> RunLayout | None:
        """The run arrays to read `wanted` into, or None for the per-block read (switched off, no
        layout known, or a block that is not whole)."""
        layout = run_layout(self.table_rules) if self.run_reads else None
        if layout is None or not wanted or any(len(ids) != layout.block_size for _, ids in wanted):
            return None
        return layout

    def _indexed(self, wanted: Sequence[tuple[bytes, Sequence[int]]]) -> list[tuple[bytes, IndexEntry]]:
        """(hash, index entry) of `wanted`'s blocks up to the first the folder does not hold (a miss)."""
        out = []
        for block_hash, _ in wanted:
            with self._lock:
                entry = self._index.get(block_hash)
            entry = entry if entry is not None else self._adopt(block_hash)
            if entry is None:
                with self._lock:
                    self._stats["misses"] += 1
                break
            out.append((block_hash, entry))
        return out

    def _in_place(self) -> bool:
        return not (self.host_reads if self.host_reads is not None else reads_through_host())

    def _load_run(
        self,
        wanted: Sequence[tuple[bytes, Sequence[int]]],
        layout: RunLayout,
        consumed: Callable[[int], None],
        into: RequestBuffers | None = None,
    ) -> list[LoadedBlock]:
        """The blocks of `wanted` up to the first that misses, read as runs of at most RUN_BYTES an
        array (one for most chains; with `into`, one: the request's own buffers): mlx reads a window
        of files while the reading threads verify and place the windows before it."""
        if into is not None:
            return self._load_one_run(wanted, layout, consumed, into)
        size = max(1, RUN_BYTES // layout.block_bytes())
        out: list[LoadedBlock] = []
        for start in range(0, len(wanted), size):
            part = wanted[start : start + size]
            out += self._load_one_run(part, layout, _after(consumed, start))
            if len(out) < start + len(part):
                break
        return out

    def _load_one_run(
        self,
        wanted: Sequence[tuple[bytes, Sequence[int]]],
        layout: RunLayout,
        consumed: Callable[[int], None],
        into: RequestBuffers | None = None,
    ) -> list[LoadedBlock]:
        if not self._in_place():
            started, buffers = self._begin_run(wanted, layout, into)
            return self._collect_run(started, buffers, consumed)
        entries = self._indexed(wanted)
        if not entries:
            return []
        buffers = RunBuffers(layout, len(entries), True, into)
        wanted = wanted[: len(entries)]
        windows = [wanted[start : start + WINDOW] for start in range(0, len(wanted), WINDOW)]
        pool, placed, in_flight = self._read_pool(), [], deque()
        opened = self._open_window(windows[0])
        mx.async_eval([payload for *_, payload in opened])
        buffers.start()  # while mlx reads the first window
        for i, window in enumerate(windows):
            following = None
            if len(opened) == len(window) and i + 1 < len(windows):
                following = self._open_window(windows[i + 1])
                mx.async_eval([payload for *_, payload in following])
            try:
                mx.eval([payload for *_, payload in opened])
            except Exception:  # one damaged file fails the whole read: read them one by one
                opened = self._read_one_by_one(opened)
            futures = []
            for (block_hash, entry, header, payload), (_, ids) in zip(opened, window, strict=False):
                view = memoryview(payload)  # made here, on mlx's thread; it keeps the payload alive
                task = pool.submit(
                    verify_into_run, self.namespace, header, view, ids, len(placed), buffers, key=self.key
                )
                placed.append((block_hash, entry, task))
                futures.append(task)
            in_flight.append(futures)
            consumed(len(placed))  # read: the kernel's lead moves on
            if i == 0:
                self._allocate(buffers)  # its tasks place it once the buffers are made
            if len(in_flight) > WINDOWS_AHEAD:  # bounded: the payloads wait beside the run
                wait(in_flight.popleft())
            if len(opened) < len(window) or following is None:
                break
            opened = following
        return self._collect_run(placed, buffers, consumed)

    def _allocate(self, buffers: RunBuffers) -> None:
        try:
            buffers.allocate()
        except Exception as exc:  # out of memory: every block fails (a miss), no file is judged
            log.warning("SSD read: the run's buffers could not be made (%s)", exc)

    def _begin_run(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], layout: RunLayout, into: RequestBuffers | None = None
    ) -> tuple[list[tuple[bytes, IndexEntry, Future]], RunBuffers | None]:
        """Start reading the indexed blocks of `wanted` into one run on the reading threads (a
        block each: read, verified, placed); the buffers are made meanwhile."""
        entries = self._indexed(wanted)
        if not entries:
            return [], None
        buffers = RunBuffers(layout, len(entries), self._in_place(), into)
        pool: ThreadPoolExecutor = self._read_pool()
        started = [
            (block_hash, entry, pool.submit(
                read_into_run, self._path(block_hash), self.namespace, block_hash, ids, i, buffers,
                key=self.key, expect=self.table_rules,
            ))
            for i, ((block_hash, entry), (_, ids)) in enumerate(zip(entries, wanted, strict=False))
        ]  # fmt: skip
        self._allocate(buffers)  # while the first files are read and verified
        return started, buffers

    def _begin_run_load(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], layout: RunLayout, into: RequestBuffers | None = None
    ) -> PendingLoad:
        started, buffers = self._begin_run(wanted, layout, into)
        expected = tuple(tuple(ids) for _, ids in wanted[: len(started)])
        return PendingLoad(expected, [(h, e, None, f) for h, e, f in started], buffers)

    def _collect_run(
        self,
        started: list[tuple[bytes, IndexEntry, Future]],
        buffers: RunBuffers | None,
        consumed: Callable[[int], None] | None = None,
    ) -> list[LoadedBlock]:
        """The blocks of a run read (hash, index entry, the future of its read_into_run or
        verify_into_run), in order, up to the first that fails: the run's arrays made once, each
        block's full-attention arrays views of them (one split per array)."""
        reads = []
        for block_hash, entry, future in started:
            try:
                read = future.result()
            except MemoryError:  # the run's buffers: not the file's fault
                with self._lock:
                    self._stats["misses"] += 1
                break
            except Exception as exc:  # FormatError (checksum, table) or OSError
                self._drop_unreadable(block_hash, entry, exc)
                break
            if read.other_tokens:
                self._other_tokens(block_hash)
                break
            reads.append((block_hash, entry, read))
            if consumed is not None:
                consumed(len(reads))
        futures = [future for *_, future in started]
        for future in futures:
            future.cancel()  # past a failed block: not read
        wait(futures)  # nothing writes into the run's buffers after this
        if not reads:
            return []
        run = LoadedRun(buffers.arrays(len(reads)), len(reads), buffers.layout.block_size, buffers.into)
        if run.into is not None:  # a request's buffers: no views (the request writes them in place)
            parts = {}
        else:
            parts = {
                n: mx.split(a, run.num_blocks, axis=2) if run.num_blocks > 1 else [a] for n, a in run.arrays.items()
            }
            mx.eval(parts)
        out: list[LoadedBlock] = []
        for i, (block_hash, entry, read) in enumerate(reads):
            try:
                arrays = {n: p[i] for n, p in parts.items()} | rest_arrays(read)
            except Exception as exc:  # FormatError: a table mlx cannot use
                self._drop_unreadable(block_hash, entry, exc)
                break
            self._count_hit(block_hash, entry)
            out.append(LoadedBlock(read.header.token_ids, arrays, read.header.parent_hash, run, i))
        return out


def _after(consumed: Callable[[int], None], done: int) -> Callable[[int], None]:
    """`consumed` for a run that starts `done` blocks into the chain."""
    return lambda n: consumed(done + n)
