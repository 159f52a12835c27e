"""SSDWriterThread: block saves off the MLX thread, in batches, with seed 003's shutdown protocol.

Protocol:
- One non-daemon thread takes WriteJobs from a queue bounded in bytes (write_queue.py) in batches: what is
  queued when it wakes, up to `max_batch_jobs` / `max_batch_bytes`, saved with one call of
  `save_batch` (the store writes every file, then fsyncs them back to back: one durability step per
  batch instead of one per file). With only `save` given, jobs are saved one by one.
- `enqueue` counts itself in flight under `_life_lock` until its job is queued (or saved);
  `stop` sets closing, waits on a Condition until no enqueue is in flight, then closes the queue.
  So nothing is accepted after the close, and every enqueue that returned True is saved (or shed,
  counted) before the thread ends.
- A hash already pending (queued or being saved) is not queued again.
- A full queue (`when_full`): "write_inline" waits up to `put_timeout_s` (50 ms) for room, else the
  caller saves the job on its own thread; "shed" never waits: the least valuable job is dropped
  (the deepest unpinned block, tails first; `value`), the new one included. Pinned jobs are never
  shed: when every queued job is pinned, the caller saves the job itself. Each outcome is counted.
- A `backlog` (the SSD tier: blocks shed from the queue while still in RAM) is asked for more jobs,
  shallowest first, whenever the queue runs empty (after a batch, when idle, and in the drain while
  its limit allows), so a prefix longer than the queue still reaches the disk whole, in the background.
- Durability "best_effort": one attempt per job. "persistent": up to `max_retries` more
  attempts when the save returns ERROR (or raises), with a short linear backoff. Neither rolls
  anything back in RAM, and "persistent" is a retry policy, not an fsync promise.
- `hold(max_s)` makes the thread wait before its next batch, and before the next file of the batch
  it is saving (`pause_point`, called by the save function), until `resume()` or `max_s` passed, so a
  request's prefill does not share the cores with background writes; `stop` ends a hold.
- The thread measures its write bandwidth. `stop` drains for as long as the queued bytes take at
  that speed (`drain_estimate`: the backlog's bytes included, with a margin), never longer than the caller's ceiling, the most
  valuable jobs first; what is still queued then is dropped and logged (count, bytes, depths), and
  the batch in progress is waited for: nothing is written after `stop` returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .store import SaveResult
from .write_jobs import MIB, Backlog, DrainEstimate, SaveBatchFn, SaveFn, WriteJob, job_nbytes, log_drain, log_dropped
from .write_queue import Bandwidth, JobValue, Queued, WriteQueue

__all__ = ["MIB", "Backlog", "DrainEstimate", "SSDWriterThread", "WriteJob", "job_nbytes"]  # their old home

log = logging.getLogger(__name__)

DURABILITIES = ("best_effort", "persistent")
WHEN_FULL = ("write_inline", "shed")
WRITER_NICENESS = 10
ASSUMED_BYTES_PER_S = 128 * MIB  # before the first batch is measured: a slow disk, so the drain asks for more time
# The drain asks for this many times its estimate, plus DRAIN_SLACK_S: a disk a third slower than
# measured still drains whole; one stalled for longer is given up on, not waited for to the ceiling.
DRAIN_MARGIN = 1.5
DRAIN_SLACK_S = 2.0


def _lower_priority() -> None:
    """Let requests win the CPU over background writes (Linux: per-thread niceness; elsewhere a
    no-op). Writes still finish; they only yield while a request is prefilling or decoding."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITER_NICENESS:  # never raise a priority
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICENESS)
    except (AttributeError, OSError):
        pass


class SSDWriterThread:
    def __init__(
        self,
        save: SaveFn | None = None,
        queue_size: int | None = 512,
        durability: str = "best_effort",
        max_retries: int = 3,
        retry_backoff_s: float = 0.05,
        put_timeout_s: float = 0.05,
        after_job: Callable[[], None] | None = None,
        idle_upkeep_s: float = 60.0,
        save_batch: SaveBatchFn | None = None,
        max_batch_jobs: int = 32,
        max_batch_bytes: int = 64 * MIB,
        when_full: str = "write_inline",
        value: Callable[[WriteJob], JobValue] | None = None,
        on_shed: Callable[[WriteJob], None] | None = None,
        queue_bytes: int | None = None,
        backlog: Backlog | None = None,
    ):
        """Starts the thread. `save` is usually `SSDStore.save_block`, `save_batch` `SSDStore.save_blocks`
        (one of them is needed; `save_batch` wins). `after_job` runs on the writer thread after each
        batch (e.g. `lambda: store.maybe_flush(1.0)`, keeping index writes off the MLX thread); it
        also runs every `idle_upkeep_s` while no job arrives, so an idle server still flushes its
        index and prunes. `value(job)` ranks jobs for shedding (default: unpinned, by depth);
        `on_shed(job)` is told of each job dropped. The queue holds at most `queue_bytes` (None: no
        byte bound) and `queue_size` jobs (None: no count bound). `backlog` is asked for more jobs
        whenever the queue runs empty. Raises ValueError for an unknown durability or `when_full`,
        or a queue_size or queue_bytes below 1."""
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, got {durability!r}")
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {', '.join(WHEN_FULL)}, got {when_full!r}")
        if queue_size is not None and queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if queue_bytes is not None and queue_bytes < 1:
            raise ValueError(f"queue_bytes must be >= 1, got {queue_bytes}")
        if save is None and save_batch is None:
            raise ValueError("the writer needs save or save_batch")
        self._save = save
        self._save_batch = save_batch
        self._attempts = 1 + (max_retries if durability == "persistent" else 0)
        self._retry_backoff_s = retry_backoff_s
        self._put_timeout_s = put_timeout_s
        self._after_job = after_job
        self._idle_upkeep_s = idle_upkeep_s
        self._max_batch_jobs = max(1, max_batch_jobs)
        self._max_batch_bytes = max_batch_bytes
        self._when_full = when_full
        self._value = value or (lambda job: JobValue(False, job.depth))
        self._on_shed = on_shed
        self._queue = WriteQueue(queue_size, self._value, queue_bytes)
        self._backlog = backlog
        # Guards _backlog_closed: a refill is taken and queued under it, so none lands after the drain's cut.
        self._refill_lock = threading.Lock()
        self._backlog_closed = False
        self.bandwidth = Bandwidth()
        self._pending_lock = threading.Lock()  # guards _pending, _saving_bytes, _refilling
        self._pending: set[bytes] = set()
        self._saving_bytes = 0  # of the batch being saved now
        self._refilling = False  # taking jobs from the backlog: not idle, though none is pending yet
        self._life_lock = threading.Lock()  # guards _closing, _inflight_enqueues, _close_owed
        self._no_inflight = threading.Condition(self._life_lock)
        self._closing = False
        self._inflight_enqueues = 0
        self._close_owed = False  # stop() gave up waiting: the last in-flight enqueue closes the queue
        self._hold = threading.Condition()  # guards _hold_until
        self._hold_until = 0.0  # monotonic time until which the thread waits before its next batch
        self._stats_lock = threading.Lock()  # guards _stats; taken last, never held while taking another
        keys = ("enqueued", "immediate_puts", "timeout_puts", "sync_fallbacks", "dedup_pending", "dropped_after_close")
        keys += ("written", "declined", "retries", "failures", "held", "batches", "shed", "shed_bytes")
        keys += ("dropped_at_stop", "dropped_at_stop_bytes", "refilled", "refilled_bytes")
        self._stats = dict.fromkeys(keys, 0)
        self._thread = threading.Thread(target=self._run, name="ssd-writer", daemon=False)
        self._thread.start()

    def attach_backlog(self, backlog: Backlog) -> None:
        """Set the backlog (the tier, made after its writer)."""
        with self._refill_lock:
            self._backlog = backlog

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_idle(self, timeout_s: float) -> int:
        """Wait until no job is queued, being saved or owed by the backlog, at most `timeout_s` (an
        admin flush must not be undone by writes queued before it). Returns how many jobs are still
        pending (0: idle; 1 while only the backlog owes some)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._pending_lock:  # the backlog read under it too: a refill moves jobs from one to the other
                owed = self._backlog is not None and self._backlog.backlog_bytes() > 0
                pending = len(self._pending) or int(self._refilling or owed)
            if not pending or time.monotonic() >= deadline or not self._thread.is_alive():
                return pending
            time.sleep(0.01)

    def _inc(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def enqueue(self, job: WriteJob) -> bool:
        """Hand a block to the writer. True: it will be saved (or was, on this thread, when the
        queue stayed full), unless it is shed later for a more valuable one. False: the writer is
        closing, the same hash is already pending, or the job was shed at once."""
        with self._life_lock:
            if self._closing:
                self._inc("dropped_after_close")
                return False
            self._inflight_enqueues += 1
        try:
            with self._pending_lock:
                if job.block_hash in self._pending:
                    self._inc("dedup_pending")
                    return False
                self._pending.add(job.block_hash)
            self._inc("enqueued")
            return self._put(job, job_nbytes(job))
        finally:
            with self._life_lock:
                self._inflight_enqueues -= 1
                if self._closing and self._inflight_enqueues == 0:
                    self._no_inflight.notify_all()
                    if self._close_owed:
                        self._queue.close()

    def _put(self, job: WriteJob, nbytes: int) -> bool:
        if self._queue.put(job, nbytes):
            self._inc("immediate_puts")
            return True
        if self._when_full == "shed":
            while True:  # each call drops at most one job; a bigger new one may need a second
                queued, dropped = self._queue.put_shedding(job, nbytes)
                if dropped is not None:
                    self._shed(dropped)
                if queued or (dropped is not None and dropped.job is job):
                    return queued
                if dropped is None:
                    break
        elif self._queue.put(job, nbytes, self._put_timeout_s):
            self._inc("timeout_puts")
            return True
        self._inc("sync_fallbacks")  # still full (shed: of pinned jobs only): saved on this thread
        self._process([job])
        return True

    def _shed(self, dropped: Queued) -> None:
        with self._pending_lock:
            self._pending.discard(dropped.job.block_hash)
        with self._stats_lock:
            self._stats["shed"] += 1
            self._stats["shed_bytes"] += dropped.nbytes
        if self._on_shed is not None:
            self._on_shed(dropped.job)

    def hold(self, max_s: float) -> None:
        """Pause before the next batch until `resume()`, at most `max_s` seconds from now (0: no-op).
        Jobs keep being accepted; a batch already being saved stops after its file in progress
        (`pause_point`) and goes on when the hold ends."""
        with self._life_lock:
            if self._closing:
                return
        if max_s > 0:
            with self._hold:
                self._hold_until = time.monotonic() + max_s

    def resume(self) -> None:
        with self._hold:
            if self._hold_until:
                self._hold_until = 0.0
                self._hold.notify_all()

    def pause_point(self) -> None:
        """Between two files of a batch (the save function calls it before each): wait while a hold
        is on, so a request that began prefilling after the batch started gets the cores back once
        the file in progress is written. No-op off the writer thread (an inline save never waits)."""
        if threading.current_thread() is not self._thread:
            return
        with self._hold:
            self._wait_out_hold()

    def _take_when_not_held(self) -> list[Queued]:
        """The next batch, taken once no hold is on. Checking and taking under the hold's lock makes
        it exact: a batch is either taken before a hold() returns or after the hold ends."""
        with self._hold:
            self._wait_out_hold()
            return self._queue.take(self._max_batch_jobs, self._max_batch_bytes)

    def _wait_out_hold(self) -> None:
        """Wait (the hold's lock held) until no hold is on; a wait is counted in `writer_held`."""
        if time.monotonic() < self._hold_until:
            self._inc("held")
        while (remaining := self._hold_until - time.monotonic()) > 0:
            self._hold.wait(remaining)

    def stop(self, drain_timeout: float = 5.0) -> bool:
        """Stop accepting jobs, wait for in-flight enqueues, and let the thread save what is queued
        (most valuable first: pinned, then shallow) and exit. The drain waits what the queued bytes
        take at the measured bandwidth (`drain_estimate().limit_s`), at most `drain_timeout` (the
        ceiling). Jobs still queued then are dropped, counted (`writer_dropped_at_stop`) and logged
        (how many, bytes, pinned, depths), and the batch in progress is waited for (one batch's
        time): nothing is written after this returns. True if everything was written. When an
        enqueue is still in flight at the limit, nothing is dropped: the thread drains and exits
        later (non-daemon, the process waits for it). Safe to call twice."""
        start = time.monotonic()
        estimate = self.drain_estimate()
        deadline = start + estimate.limit_s(drain_timeout)
        if self._thread.is_alive():
            log_drain(estimate, drain_timeout)
        self._queue.sort_by_value()  # before the thread takes its next batch
        self.resume()  # a held writer drains at once
        with self._life_lock:
            self._closing = True
            while self._inflight_enqueues > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._close_owed = True
                    log.error(
                        "SSD writer: %d enqueues still in flight after %.1fs",
                        self._inflight_enqueues,
                        time.monotonic() - start,
                    )
                    return False
                self._no_inflight.wait(remaining)
            self._queue.sort_by_value()  # again, with what in-flight enqueues added
            self._queue.close()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            log.info("SSD writer drained in %.2f s", time.monotonic() - start)
            return True
        with self._refill_lock:  # no refill after this: the thread ends after its batch in progress
            self._backlog_closed = True
        if owed := self._backlog.backlog_bytes() if self._backlog else 0:
            log.warning("SSD writer: %.1f MiB of RAM blocks not on the SSD were not written by the drain", owed / MIB)
        self._drop_queued(time.monotonic() - start)
        last_batch_s = self._max_batch_bytes / estimate.bytes_per_s * DRAIN_MARGIN + DRAIN_SLACK_S
        self._thread.join(last_batch_s)
        if self._thread.is_alive():
            log.error("SSD writer: its last batch is still being written after %.1f s more", last_batch_s)
        return False

    def _drop_queued(self, waited_s: float) -> None:
        """The drain's limit passed: drop every job still queued, and say exactly what."""
        dropped = self._queue.drop_all()
        if not dropped:
            return
        with self._pending_lock:
            self._pending.difference_update(q.job.block_hash for q in dropped)
        with self._stats_lock:
            self._stats["dropped_at_stop"] += len(dropped)
            self._stats["dropped_at_stop_bytes"] += sum(q.nbytes for q in dropped)
        log_dropped(waited_s, [q.nbytes for q in dropped], [self._value(q.job) for q in dropped])
        if self._on_shed is not None:
            for q in dropped:
                self._on_shed(q.job)

    def drain_estimate(self) -> DrainEstimate:
        """What a drain would write now (the queue, the batch being saved and the backlog) and how
        long it should take at the measured bandwidth (an assumed slow disk before the first batch)."""
        with self._pending_lock:
            saving = self._saving_bytes
        nbytes = self._queue.queued_bytes + saving + (self._backlog.backlog_bytes() if self._backlog else 0)
        bytes_per_s = self.bandwidth.bytes_per_s() or ASSUMED_BYTES_PER_S
        return DrainEstimate(self._depth(), nbytes, bytes_per_s, nbytes / bytes_per_s * DRAIN_MARGIN + DRAIN_SLACK_S)

    def _run(self) -> None:
        _lower_priority()
        while True:
            ready = self._queue.wait(self._idle_upkeep_s)
            if not ready and self._refill():
                continue
            if ready is None:  # closed and drained, the backlog included (or cut)
                return
            if not ready:  # idle: upkeep only
                self._upkeep()
                continue
            batch = self._take_when_not_held()
            if not batch:
                continue
            with self._pending_lock:
                self._saving_bytes = sum(q.nbytes for q in batch)
            try:
                self._process([q.job for q in batch])
            finally:
                with self._pending_lock:
                    self._saving_bytes = 0
            self._upkeep()
            if not len(self._queue):
                self._refill()

    def _refill(self) -> bool:
        """The queue ran empty: queue the backlog's next jobs (about one batch, within the queue's
        room), skipping any already pending. True when something was queued."""
        if self._backlog is None:
            return False
        with self._refill_lock:
            if self._backlog_closed:
                return False
            with self._pending_lock:
                self._refilling = True
            try:
                jobs = self._backlog.take_backlog(max(1, min(self._max_batch_bytes, self._queue.free_bytes())))
            except Exception:
                log.exception("SSD writer: taking its backlog failed")
                jobs = []
            with self._pending_lock:
                jobs = [j for j in jobs if j.block_hash not in self._pending]
                self._pending.update(j.block_hash for j in jobs)
                self._refilling = False
            items = [(j, job_nbytes(j)) for j in jobs]
            self._queue.put_all(items)
        with self._stats_lock:
            self._stats["refilled"] += len(items)
            self._stats["refilled_bytes"] += sum(n for _, n in items)
        return bool(items)

    def _upkeep(self) -> None:
        if self._after_job is not None:
            try:
                self._after_job()
            except Exception:
                log.exception("SSD writer: after_job hook failed")

    def _process(self, jobs: list[WriteJob]) -> None:
        """Save jobs under the durability policy (measuring the bandwidth), then release their hashes."""
        try:
            started = time.perf_counter()
            results = self._attempt(jobs)
            self.bandwidth.add(
                sum(job_nbytes(j) for j, r in zip(jobs, results, strict=True) if r is SaveResult.SAVED),
                time.perf_counter() - started,
            )
            self._inc("batches")
            for job, result in zip(jobs, results, strict=True):
                self._finish(job, result)
        finally:
            with self._pending_lock:
                self._pending.difference_update(j.block_hash for j in jobs)

    def _finish(self, job: WriteJob, result: SaveResult) -> None:
        """Count a job's outcome, retrying it alone first if it failed and the durability allows."""
        for attempt in range(1, self._attempts):
            if result is not SaveResult.ERROR:
                break
            self._inc("retries")
            time.sleep(self._retry_backoff_s * attempt)
            result = self._attempt([job])[0]
        if result is SaveResult.ERROR:
            self._inc("failures")
            log.warning("SSD writer gave up on block %s after %d attempts", job.block_hash.hex()[:16], self._attempts)
        else:
            self._inc("written" if result is SaveResult.SAVED else "declined")

    def _attempt(self, jobs: list[WriteJob]) -> list[SaveResult]:
        """One attempt per job, in one batch when a batch function is given; a save that raises is
        an ERROR (it must not kill the writer)."""
        if self._save_batch is not None:
            try:
                results = [SaveResult(r) for r in self._save_batch(jobs)]
                if len(results) != len(jobs):
                    raise ValueError(f"{len(results)} results for {len(jobs)} jobs")
                return results
            except Exception:
                log.exception("SSD writer: a batch save of %d blocks raised", len(jobs))
                return [SaveResult.ERROR] * len(jobs)
        results = []
        for job in jobs:
            self.pause_point()
            try:
                results.append(SaveResult(self._save(job.block_hash, job.parent_hash, job.token_ids, job.arrays)))
            except Exception:
                log.exception("SSD writer: save of block %s raised", job.block_hash.hex()[:16])
                results.append(SaveResult.ERROR)
        return results

    def _depth(self) -> int:
        """Jobs queued."""
        return len(self._queue)

    def stats(self) -> dict[str, Any]:
        """`writer_*` counters. `declined`: the store answered dedup, collision or skipped. `shed`:
        jobs dropped because the queue was full (`shed_bytes` their size); `refilled`: jobs taken back
        from the backlog (shed ones RAM still held) when the queue ran empty. `bandwidth_mib_s`: the
        recent write speed (0 before the first batch)."""
        depth = self._depth()
        with self._pending_lock:
            pending = len(self._pending)
        bandwidth = self.bandwidth.bytes_per_s() or 0.0
        queued_bytes = self._queue.queued_bytes
        with self._stats_lock:
            out: dict[str, Any] = {f"writer_{k}": v for k, v in self._stats.items()}
        out["writer_queue_depth"] = depth
        out["writer_queued_bytes"] = queued_bytes
        out["writer_pending"] = pending
        out["writer_bandwidth_mib_s"] = round(bandwidth / MIB, 1)
        return out
