"""The SSD tier behind the RAM tier: what KVManager calls when blocks are created, evicted or
missing from RAM. Writes go through the writer thread (never on the caller's lock); reads are
verified by the store, synchronous (`load_many`: the request needs the blocks now) or started in
the background while the engine computes (`begin_load` / `end_load`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...checked_json import DamagedFile
from .. import runs
from ..base import Block, RequestBuffers
from .format import BlockHeader, block_relpath, read_header, tail_key
from .loaded import LoadedBlock
from .reads import PendingLoad
from .shutdown_record import read_shutdown_record, write_shutdown_record
from .store import SaveResult, SSDStore
from .tails import SSDTailStore
from .write_queue import Bandwidth, JobValue
from .writer import SSDWriterThread, WriteJob, job_nbytes

log = logging.getLogger(__name__)

POLICIES = ("write_through", "evict_only")
PRUNE_INTERVAL_S = 3600.0
TAIL_DEPTH = 2**31  # a tail ranks below every block of its chain when the writer sheds
# Tails shed from the writer's queue held for it (their arrays: RAM does not look tails up by hash),
# the newest kept within this many bytes, written after the owed blocks when its queue runs empty.
OWED_TAIL_BYTES = 256 * 1024**2


class SSDTier:
    """`to_arrays(payload)` / `from_arrays(arrays) -> (payload, nbytes)` convert block payloads to
    the store's named arrays; only the engine knows their layout. `exact_tails`: tails carry
    checkpoints and are usable only whole (see TailStore)."""

    def __init__(
        self,
        store: SSDStore,
        writer: SSDWriterThread,
        policy: str,
        to_arrays: Callable[[Any], dict],
        from_arrays: Callable[[dict], tuple[Any, int]],
        flush_interval_s: float = 2.0,
        async_writes: bool = True,
        write_hold_s: float = 0.0,
        exact_tails: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.store = store
        self.writer = writer
        self.block_reads = Bandwidth()  # verified blocks loaded per second (read, checksum, arrays)
        self.policy = policy
        self._to_arrays = to_arrays
        self._from_arrays = from_arrays
        self.flush_interval_s = flush_interval_s
        self.async_writes = async_writes
        self.write_hold_s = write_hold_s
        self._last_prune = time.time()
        self.damaged_files: list[DamagedFile] = []  # a shutdown record found damaged (and set aside)
        # The shutdown record is the owner's (a guest neither consumes nor writes it).
        self.last_shutdown = (
            read_shutdown_record(store.cache_dir, self.damaged_files)
            if store.is_owner
            else {"shutdown_clean": None, "shutdown_partial_flush": None}
        )
        self.validation: dict[str, Any] = {}  # the startup validate_index report
        self.tails = SSDTailStore(
            store.cache_dir / "tails",
            store.namespace,
            exact=exact_tails,
            may_delete=store.is_owner,
            key=store.key,
            table_rules=store.table_rules,
        )
        store.attach_secondary(self.tails)  # every byte the tier writes counts in one budget
        self._tail_lock = threading.Lock()  # guards _tail_keys
        # Writer jobs that are tails, not blocks, each with its tail's last use (registered, or served
        # from RAM while queued): the file's mtime once written, whenever the writer gets to it.
        self._tail_keys: dict[bytes, float] = {}
        # Blocks owed to the SSD beyond the writer's queue (shed from it, or RAM's at an evict_only
        # shutdown): hash -> (depth, nbytes). The writer takes them back, shallowest first, while RAM
        # still holds them (`ram_blocks`, set by attach_ram), whenever its queue runs empty.
        self._owed_lock = threading.Lock()  # guards _owed
        self._owed: dict[bytes, tuple[int, int]] = {}
        self._owed_tails: dict[bytes, tuple[WriteJob, float]] = {}  # tail key -> (job, last use), oldest first
        self._ram_blocks: Callable[[Sequence[bytes]], dict[bytes, Block]] | None = None

    def attach_ram(self, ram_blocks: Callable[[Sequence[bytes]], dict[bytes, Block]]) -> None:
        """`ram_blocks(hashes)`: those of `hashes` RAM holds now (KVManager.blocks_in_ram). Without it
        nothing shed is offered again."""
        self._ram_blocks = ram_blocks

    def _job(self, block: Block) -> WriteJob:
        """The block's own arrays, named (no copy: a queued block costs memory only once RAM drops it)."""
        arrays = self._to_arrays(block.payload)
        return WriteJob(block.block_hash, block.parent_hash, block.token_ids, arrays, block.depth)

    def _write(self, block: Block) -> None:
        job = self._job(block)
        if self.async_writes:
            self.writer.enqueue(job)
        else:
            self.store.save_blocks([job])

    def hold_writes(self) -> None:
        """A request is prefilling: background writes wait until `resume_writes`, at most
        write_hold_s (its first token is what the user waits for; the writes can wait)."""
        self.writer.hold(self.write_hold_s)

    def resume_writes(self) -> None:
        self.writer.resume()

    def on_new_block(self, block: Block) -> None:
        if self.policy == "write_through":
            self._write(block)

    def on_evicted(self, blocks: list[Block]) -> None:
        if self.policy == "evict_only":
            for block in blocks:
                if not self.store.contains(block.block_hash):
                    self._write(block)
            return
        with self._owed_lock:  # write_through: a block owed (shed) is queued once more on its way out
            owed = [b for b in blocks if self._owed.pop(b.block_hash, None) is not None]
        for block in owed:
            if not self.store.contains(block.block_hash):
                self._write(block)

    def persist_resident(self, blocks: list[Block]) -> int:
        """At shutdown: under evict_only, owe the SSD the RAM blocks it lacks, so that the drain
        writes them, shallowest first, within its limit (a restart finds the longest prefixes).
        Returns how many are owed."""
        if self.policy != "evict_only":
            return 0
        if self._ram_blocks is None:  # nothing to take them back from: queue them (most recent first)
            return self.persist(blocks[::-1])
        missing = [b for b in blocks if not self.store.contains(b.block_hash)]
        with self._owed_lock:
            self._owed.update((b.block_hash, (b.depth, b.nbytes)) for b in missing)
        return len(missing)

    def persist(self, blocks: list[Block]) -> int:
        """Write the given blocks the SSD lacks, whatever the policy (pinned blocks: so they can be
        demoted instead of held in RAM beyond the pinned share). Returns how many were queued."""
        queued = 0
        for block in blocks:
            if not self.store.contains(block.block_hash):
                self._write(block)
                queued += 1
        return queued

    def load(self, block_hash: bytes, token_ids: Sequence[int]) -> tuple[Any, int] | None:
        """(payload, nbytes) of a verified block on the SSD, or None."""
        loaded = self.store.load_block(block_hash, token_ids)
        got = self._payloads([(block_hash, token_ids)], [loaded] if loaded is not None else [])
        return got[0] if got else None

    def load_many(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], into: RequestBuffers | None = None
    ) -> list[tuple[Any, int]]:
        """(payload, nbytes) of the verified blocks of `wanted` (hash, token ids), in order, up to
        the first miss; their files are read together (SSDStore.load_blocks). Measures the blocks
        loaded per second (`block_reads`). `into`: read into a request's own buffers where the
        chain is read as a run: then the payloads are a direct run's (kv/runs.py `is_direct`)."""
        start = time.perf_counter()
        out = self._payloads(wanted, self.store.load_blocks(wanted, into))
        if out:
            self.block_reads.add(len(out), time.perf_counter() - start)
        return out

    def begin_load(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], into: RequestBuffers | None = None
    ) -> PendingLoad:
        """Start reading `wanted` in the background (SSDStore.begin_load); `end_load` collects it."""
        return self.store.begin_load(wanted, into)

    def end_load(self, pending: PendingLoad) -> list[tuple[Any, int]]:
        """(payload, nbytes) of a begin_load's verified blocks, in order, up to the first miss."""
        wanted = [(opened[0], ids) for opened, ids in zip(pending.opened, pending.expected, strict=True)]
        return self._payloads(wanted, self.store.end_load(pending))

    def stored_run(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, the index lists (no file is read)."""
        for i, block_hash in enumerate(hashes):
            if not self.store.contains(block_hash):
                return i
        return len(hashes)

    def _payloads(self, wanted: Sequence[tuple[bytes, Sequence[int]]], loaded: list) -> list[tuple[Any, int]]:
        """(payload, nbytes) of each loaded block; blocks read into a run (run_reads.py) stay one in
        RAM (kv/runs.py): their full-attention entries views of its arrays, a hit joining a few."""
        out = []
        made: dict[int, runs.Run] = {}  # by id of the LoadedRun
        for (block_hash, _), block in zip(wanted, loaded, strict=False):
            try:
                if block.run is not None and block.run.into is not None:
                    out.append(self._direct_payload(block, made))
                    continue
                payload, nbytes = self._from_arrays(block.arrays)
                if block.run is not None:
                    run = made.get(id(block.run))
                    if run is None:
                        run = made[id(block.run)] = runs.Run(
                            self._from_arrays(block.run.arrays)[0], block.run.num_blocks
                        )
                    payload = runs.RunPayload(payload, run, block.position * block.run.block_size)
                out.append((payload, nbytes))
            except Exception as exc:  # a file whose arrays make no payload is damaged: never a 500
                self.store.discard(block_hash, exc)
                break
        return out

    def _direct_payload(self, block: LoadedBlock, made: dict[int, runs.Run]) -> tuple[Any, int]:
        """(payload, nbytes) of a block read into a request's buffers: a direct run's, no views."""
        loaded, bs = block.run, block.run.block_size
        run = made.get(id(loaded))
        if run is None:
            layers = self._from_arrays(loaded.arrays)[0]
            run = made[id(loaded)] = runs.Run(layers, loaded.into.positions // bs, direct=True)
        nbytes = sum(a.nbytes for a in loaded.arrays.values()) * bs // loaded.into.positions
        start = (loaded.into.lead_blocks + block.position) * bs
        return runs.RunPayload([None] * len(run.layers), run, start), nbytes

    def save_tail(self, parent_hash: bytes, token_ids: Sequence[int], payload: Any) -> None:
        """Persist a tail, through the writer thread like blocks (off the request path)."""
        arrays = self._to_arrays(payload)
        if not self.async_writes:
            self._save_tail(parent_hash, token_ids, arrays)
            return
        key = tail_key(parent_hash, token_ids)
        with self._tail_lock:
            queued = key in self._tail_keys
            self._tail_keys[key] = time.time()
        if queued:  # still waiting for the writer (RAM dropped and re-made it): written once, with this use
            return
        if not self.writer.enqueue(WriteJob(key, parent_hash, tuple(token_ids), arrays)):
            with self._tail_lock:
                self._tail_keys.pop(key, None)

    def save_job(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int], arrays: dict) -> SaveResult:
        """The writer's save function: a tail job (its key was registered by save_tail) or a block."""
        with self._tail_lock:
            used_at = self._tail_keys.pop(block_hash, None)
        if used_at is not None:
            return self._save_tail(parent_hash, token_ids, arrays, used_at)
        return self.store.save_block(block_hash, parent_hash, token_ids, arrays)

    def save_jobs(self, jobs: Sequence[WriteJob]) -> list[SaveResult]:
        """The writer's batch save function: tails one by one, blocks in one store batch (one
        durability step for all). Results in the order of `jobs`."""
        with self._tail_lock:
            used_at = [self._tail_keys.pop(job.block_hash, None) for job in jobs]
        results: list[SaveResult | None] = [None] * len(jobs)
        for i, (job, at) in enumerate(zip(jobs, used_at, strict=True)):
            if at is not None:  # a tail: its own file, the writer's pause before it as before a block's
                self.writer.pause_point()
                results[i] = self._save_tail(job.parent_hash, job.token_ids, job.arrays, at)
        positions = [i for i, at in enumerate(used_at) if at is None]
        blocks = [jobs[i] for i in positions]
        for i, result in zip(positions, self.store.save_blocks(blocks, self.writer.pause_point), strict=True):
            results[i] = result
        return results

    def job_value(self, job: WriteJob) -> JobValue:
        """How much a queued write is worth keeping when the writer sheds: pinned blocks (and tails
        of pinned chains) always; tails are the deepest part of their chain."""
        with self._tail_lock:
            is_tail = job.block_hash in self._tail_keys
        if is_tail:
            return JobValue(self.store.is_pinned(job.parent_hash), TAIL_DEPTH)
        return JobValue(self.store.is_pinned(job.block_hash), job.depth)

    def forget_job(self, job: WriteJob) -> None:
        """The writer shed `job`: it will not reach save_jobs. A block is owed: the writer takes it
        back from RAM when its queue runs empty. A tail is owed with its arrays (the newest within
        OWED_TAIL_BYTES): a restart's first request needs the tail of the prompt it repeats."""
        with self._tail_lock:
            used_at = self._tail_keys.pop(job.block_hash, None)
        with self._owed_lock:
            if used_at is None:
                self._owed[job.block_hash] = (job.depth, job_nbytes(job))
                return
            self._owed_tails.pop(job.block_hash, None)
            self._owed_tails[job.block_hash] = (job, used_at)
            total = sum(job_nbytes(j) for j, _ in self._owed_tails.values())
            while total > OWED_TAIL_BYTES:
                oldest, _ = self._owed_tails.pop(next(iter(self._owed_tails)))
                total -= job_nbytes(oldest)

    def backlog_bytes(self) -> int:
        """The bytes owed (some blocks may have left RAM since: then they are not written)."""
        with self._owed_lock:
            tails = sum(job_nbytes(j) for j, _ in self._owed_tails.values())
            return tails + sum(nbytes for _, nbytes in self._owed.values())

    def take_backlog(self, max_bytes: int) -> list[WriteJob]:
        """The writer's queue ran empty: the owed blocks RAM still holds and the SSD lacks, shallowest
        first, then the owed tails, within `max_bytes` (at least one). Each is handed out once; one
        shed again is owed again."""
        jobs = self._take_owed_blocks(max_bytes) if self._ram_blocks is not None else []
        total = sum(map(job_nbytes, jobs))
        with self._owed_lock:
            while self._owed_tails:
                key, (job, used_at) = next(iter(self._owed_tails.items()))
                if jobs and total + job_nbytes(job) > max_bytes:
                    break
                del self._owed_tails[key]
                with self._tail_lock:
                    if key in self._tail_keys:  # queued again meanwhile (save_tail): written once
                        continue
                    self._tail_keys[key] = used_at
                jobs.append(job)
                total += job_nbytes(job)
        return jobs

    def _take_owed_blocks(self, max_bytes: int) -> list[WriteJob]:
        with self._owed_lock:
            order = sorted(self._owed.items(), key=lambda item: item[1][0])
        wanted = [h for h, _ in order if not self.store.contains(h)]
        resident = self._ram_blocks(wanted) if wanted else {}
        jobs, total, done = [], 0, []
        for block_hash, (_, nbytes) in order:
            block = resident.get(block_hash)
            if block is not None:
                if jobs and total + nbytes > max_bytes:
                    break
                jobs.append(self._job(block))
                total += nbytes
            done.append(block_hash)  # handed out, stored already, or gone from RAM
        with self._owed_lock:
            for block_hash in done:
                self._owed.pop(block_hash, None)
        return jobs

    def _save_tail(
        self, parent_hash: bytes, token_ids: Sequence[int], arrays: dict, used_at: float | None = None
    ) -> SaveResult:
        """A tail within the same free-space floor and byte budget as blocks (LRU across both)."""
        # The file's size: its arrays plus a safetensors header (identity, token ids, one entry per array).
        refused = self.store.make_room(sum(a.nbytes for a in arrays.values()) + 1024 + 160 * len(arrays))
        if refused is not None:
            low_space = not self.store.has_free_space(0)
            self.tails.stats["ssd_tail_skipped_low_space" if low_space else "ssd_tail_skipped_budget"] += 1
            return refused
        return self.tails.save(parent_hash, token_ids, arrays, used_at)

    def touch_tail(self, parent_hash: bytes, token_ids: Sequence[int]) -> None:
        """A tail was served from RAM: a use on the SSD too, so that the SSD's per-parent limit, byte
        budget and TTL (by last use) keep what RAM keeps for the next restart. A tail still queued
        for the writer gets this time when it is written."""
        key = tail_key(parent_hash, token_ids)
        with self._tail_lock:
            if key in self._tail_keys:
                self._tail_keys[key] = time.time()
                return
        self.tails.touch(parent_hash, token_ids)

    def load_tail(self, parent_hash: bytes, rest: Sequence[int]) -> tuple[tuple[int, ...], Any, int, int] | None:
        """(token ids, payload, nbytes, tokens shared with `rest`) of the best stored tail, or None."""
        loaded = self.tails.best(parent_hash, rest)
        if loaded is None:
            return None
        try:
            payload, nbytes = self._from_arrays(loaded.arrays)
        except Exception as exc:  # as in _payloads: damaged, deleted
            self.tails.discard(parent_hash, loaded.token_ids, exc)
            return None
        return loaded.token_ids, payload, nbytes, loaded.num_shared

    def contains(self, block_hash: bytes) -> bool:
        return self.store.contains(block_hash)

    def parent_of(self, block_hash: bytes) -> bytes | None:
        """The parent hash recorded in the block's file header, or None when it is not stored."""
        header = self.header_of(block_hash)
        return header.parent_hash if header is not None else None

    def header_of(self, block_hash: bytes) -> BlockHeader | None:
        """The block file's header (parent hash, token ids; its checksum is verified only by a
        load), or None when it is not stored or unreadable."""
        if not self.store.contains(block_hash):
            return None
        try:
            return read_header(self.store.cache_dir / block_relpath(block_hash), self.store.namespace)
        except (OSError, ValueError):
            return None

    def after_write(self) -> None:
        """Upkeep on the writer thread, after each write and while idle: batched index flushes
        (loads mark the index dirty too) and TTL pruning by wall time."""
        self.store.maybe_flush(self.flush_interval_s)
        self.maybe_prune()

    def maybe_prune(self) -> int:
        """TTL pruning at most once per PRUNE_INTERVAL_S of wall time. Called on the writer thread
        after each write and every minute while idle. Returns the blocks pruned."""
        if time.time() - self._last_prune < PRUNE_INTERVAL_S:
            return 0
        self._last_prune = time.time()
        if not self.store.is_owner:
            return 0
        self.tails.prune(self.store.ttl_s)
        return self.store.prune_expired()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ssd_policy": self.policy}
        out.update(self.store.stats())
        out.update(self.writer.stats())
        out.update(self.tails.stats)
        out["ssd_tail_bytes"] = self.tails.used_bytes()
        out["writer_owed_bytes"] = self.backlog_bytes()  # shed while RAM holds them (blocks) or with them (tails)
        return out

    def close(self, drain_timeout_s: float) -> bool:
        """Drain the writer, flush the index and record how the shutdown went. True when clean."""
        drained = self.writer.stop(drain_timeout_s)
        # Clean means everything acknowledged reached the disk, the index included: flush() reports
        # a failed index write (a full disk, index.json replaced by a folder) as False, never raises.
        flushed = self.store.flush()
        self.store.close_reads()  # its reading threads end (a process's last stop waits for them)
        if not flushed:
            log.error("SSD index write failed at shutdown: the shutdown is recorded as not clean")
        clean = bool(drained and flushed)
        if self.store.is_owner:
            write_shutdown_record(self.store.cache_dir, clean, partial_flush=not drained)
        log.info("SSD tier closed: shutdown_clean=%s", clean)
        return clean
