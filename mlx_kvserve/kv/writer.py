"""SSDWriterThread: block saves off the MLX thread, with seed 003's shutdown protocol.

Protocol:
- One non-daemon thread takes WriteJobs from a queue and calls `save(*job)` for each.
- `enqueue` counts itself in flight under `_life_lock` until its job is queued (or saved);
  `stop` sets closing, waits on a Condition until no enqueue is in flight, then queues the
  sentinel. So the sentinel is always the last item, nothing is accepted after it, and every
  enqueue that returned True is saved before the thread ends.
- A hash already pending (queued or being saved) is not queued again.
- Backpressure in three levels: a free slot now; a free slot within `put_timeout_s` (50 ms);
  else the caller saves synchronously on its own thread. Each level is counted.
- Durability "best_effort": one attempt per job. "persistent": up to `max_retries` more
  attempts when the save returns ERROR (or raises), with a short linear backoff. Neither rolls
  anything back in RAM, and "persistent" is a retry policy, not an fsync promise.
- `hold(max_s)` makes the thread wait before its next job until `resume()` or `max_s` passed,
  so a request's prefill does not share the cores with background writes; `stop` ends a hold.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .ssd import SaveResult

log = logging.getLogger(__name__)

DURABILITIES = ("best_effort", "persistent")
_SENTINEL = object()


WRITER_NICENESS = 10


def _lower_priority() -> None:
    """Let requests win the CPU over background writes (Linux: per-thread niceness; elsewhere a
    no-op). Writes still finish; they only yield while a request is prefilling or decoding."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITER_NICENESS:  # never raise a priority
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICENESS)
    except (AttributeError, OSError):
        pass


class WriteJob(NamedTuple):
    """What SSDStore.save_block needs; the arrays must already be evaluated (mx.eval)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: Sequence[int]
    arrays: Mapping[str, Any]


SaveFn = Callable[[bytes, bytes, Sequence[int], Mapping[str, Any]], SaveResult]


class SSDWriterThread:
    def __init__(
        self,
        save: SaveFn,
        queue_size: int = 512,
        durability: str = "best_effort",
        max_retries: int = 3,
        retry_backoff_s: float = 0.05,
        put_timeout_s: float = 0.05,
        after_job: Callable[[], None] | None = None,
        idle_upkeep_s: float = 60.0,
    ):
        """Starts the thread. `save` is usually `SSDStore.save_block`. `after_job` runs on the writer
        thread after each job (e.g. `lambda: store.maybe_flush(1.0)`, keeping index writes off the
        MLX thread); it also runs every `idle_upkeep_s` while no job arrives, so an idle server
        still flushes its index and prunes. Raises ValueError for an unknown durability or a queue_size below 1."""
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, got {durability!r}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self._save = save
        self._attempts = 1 + (max_retries if durability == "persistent" else 0)
        self._retry_backoff_s = retry_backoff_s
        self._put_timeout_s = put_timeout_s
        self._after_job = after_job
        self._idle_upkeep_s = idle_upkeep_s
        # Capacity lives in a semaphore rather than in the queue so that the sentinel never needs a
        # free slot: stop() can always queue it at once, and the thread always ends after draining.
        self._queue: queue.Queue[Any] = queue.Queue()
        self._slots = threading.BoundedSemaphore(queue_size)
        self._pending_lock = threading.Lock()  # guards _pending
        self._pending: set[bytes] = set()
        self._life_lock = threading.Lock()  # guards _closing, _inflight_enqueues, _sentinel_owed, _sentinel_queued
        self._no_inflight = threading.Condition(self._life_lock)
        self._closing = False
        self._inflight_enqueues = 0
        self._sentinel_owed = False  # stop() gave up waiting: the last in-flight enqueue queues it
        self._sentinel_queued = False
        self._hold = threading.Condition()  # guards _hold_until
        self._hold_until = 0.0  # monotonic time until which the thread waits before its next job
        self._stats_lock = threading.Lock()  # guards _stats; taken last, never held while taking another
        keys = ("enqueued", "immediate_puts", "timeout_puts", "sync_fallbacks", "dedup_pending", "dropped_after_close")
        self._stats = dict.fromkeys(keys + ("written", "declined", "retries", "failures", "held"), 0)
        self._thread = threading.Thread(target=self._run, name="ssd-writer", daemon=False)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_idle(self, timeout_s: float) -> int:
        """Wait until no job is queued or being saved, at most `timeout_s` (an admin flush must not
        be undone by writes queued before it). Returns how many jobs are still pending (0: idle)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._pending_lock:
                pending = len(self._pending)
            if not pending or time.monotonic() >= deadline or not self._thread.is_alive():
                return pending
            time.sleep(0.01)

    def _inc(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def enqueue(self, job: WriteJob) -> bool:
        """Hand a block to the writer. True: it will be saved (or was, on this thread, when the
        queue stayed full). False: the writer is closing, or the same hash is already pending."""
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
            for blocking, level in ((False, "immediate_puts"), (True, "timeout_puts")):
                if self._slots.acquire(blocking, self._put_timeout_s if blocking else None):
                    self._queue.put(job)
                    self._inc(level)
                    return True
            self._inc("sync_fallbacks")
            self._process(job)
            return True
        finally:
            with self._life_lock:
                self._inflight_enqueues -= 1
                if self._closing and self._inflight_enqueues == 0:
                    self._no_inflight.notify_all()
                    if self._sentinel_owed:
                        self._queue_sentinel()

    def hold(self, max_s: float) -> None:
        """Pause before the next job until `resume()`, at most `max_s` seconds from now (0: no-op).
        Jobs keep being accepted; a job already being saved finishes."""
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

    def _wait_while_held(self) -> None:
        with self._hold:
            if time.monotonic() >= self._hold_until:
                return
            self._inc("held")
            while (remaining := self._hold_until - time.monotonic()) > 0:
                self._hold.wait(remaining)

    def stop(self, drain_timeout: float = 5.0) -> bool:
        """Stop accepting jobs, wait for in-flight enqueues, queue the sentinel last, and wait for
        the thread to save what is queued and exit. True if all of it happened within
        `drain_timeout`. On False the thread still finishes the queue and exits later (it is
        non-daemon, so the process waits for it); nothing is dropped. Safe to call twice."""
        deadline = time.monotonic() + drain_timeout
        self.resume()  # a held writer drains at once
        with self._life_lock:
            self._closing = True
            while self._inflight_enqueues > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._sentinel_owed = True
                    log.error(
                        "SSD writer: %d enqueues still in flight after %.1fs", self._inflight_enqueues, drain_timeout
                    )
                    return False
                self._no_inflight.wait(remaining)
            self._queue_sentinel()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.error("SSD writer did not drain within %.1fs; ~%d blocks still queued", drain_timeout, self._depth())
            return False
        return True

    def _queue_sentinel(self) -> None:
        """Caller holds _life_lock, with closing set and no enqueue in flight."""
        if not self._sentinel_queued:
            self._sentinel_queued = True
            self._sentinel_owed = False
            self._queue.put(_SENTINEL)

    def _run(self) -> None:
        _lower_priority()
        while True:
            try:
                job = self._queue.get(timeout=self._idle_upkeep_s)
            except queue.Empty:  # idle: upkeep only
                self._upkeep()
                continue
            if job is _SENTINEL:
                break
            self._slots.release()
            self._wait_while_held()
            self._process(job)
            self._upkeep()

    def _upkeep(self) -> None:
        if self._after_job is not None:
            try:
                self._after_job()
            except Exception:
                log.exception("SSD writer: after_job hook failed")

    def _process(self, job: WriteJob) -> SaveResult:
        """Save one job under the durability policy, then release its hash from the pending set."""
        try:
            for attempt in range(self._attempts):
                if attempt:
                    self._inc("retries")
                    time.sleep(self._retry_backoff_s * attempt)
                result = self._attempt(job)
                if result is not SaveResult.ERROR:
                    self._inc("written" if result is SaveResult.SAVED else "declined")
                    return result
            self._inc("failures")
            log.warning("SSD writer gave up on block %s after %d attempts", job.block_hash.hex()[:16], self._attempts)
            return SaveResult.ERROR
        finally:
            with self._pending_lock:
                self._pending.discard(job.block_hash)

    def _attempt(self, job: WriteJob) -> SaveResult:
        try:
            return SaveResult(self._save(*job))
        except Exception:  # a save function that raises must not kill the writer
            log.exception("SSD writer: save of block %s raised", job.block_hash.hex()[:16])
            return SaveResult.ERROR

    def _depth(self) -> int:
        """Jobs queued, not counting the sentinel."""
        with self._life_lock:
            sentinel = 1 if self._sentinel_queued and self._thread.is_alive() else 0
        return max(0, self._queue.qsize() - sentinel)

    def stats(self) -> dict[str, int]:
        """`writer_*` counters. `declined`: the store answered dedup, collision or skipped."""
        depth = self._depth()
        with self._pending_lock:
            pending = len(self._pending)
        with self._stats_lock:
            out = {f"writer_{k}": v for k, v in self._stats.items()}
        out["writer_queue_depth"] = depth
        out["writer_pending"] = pending
        return out
