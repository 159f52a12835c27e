"""WriteQueue: the SSD writer's bounded queue, with shedding by value and a measured bandwidth.

- The bound is in bytes (`max_bytes`: the queue holds references to blocks that are mostly still in RAM,
  so what it may cost is the bytes of those evicted while queued), and optionally in jobs (`bound`,
  None: none). A job larger than the byte bound still goes into an empty queue.
- `put` queues a job when the queue has room for it (waiting up to a timeout for room).
- `put_shedding` never waits: when the queue is full it drops the least valuable job, the new one
  included: the deepest unpinned one (the newest among equals). Pinned jobs are never dropped; when
  every candidate is pinned it drops nothing and says so (the caller writes the job itself). One call
  drops at most one job; `room_for` tells the caller whether another is needed.
- `take` hands the writer thread a batch, oldest first; `close` lets it drain what is left and end;
  `drop_all` empties it (a drain past its limit).
- `Bandwidth` is the writer's recent write speed, from which the shutdown drain sizes its wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple


class JobValue(NamedTuple):
    """How much a queued write is worth keeping: pinned chains always, then shallow blocks (a shared
    system prompt) before deep ones (a conversation's tail)."""

    pinned: bool
    depth: int


def shed_order(value: JobValue) -> tuple[bool, int]:
    """Sort key, least valuable first (the order in which jobs are shed)."""
    return (value.pinned, -value.depth)


class Queued(NamedTuple):
    job: Any  # a WriteJob
    nbytes: int
    seq: int  # arrival order


class ShedResult(NamedTuple):
    queued: bool  # the new job is in the queue
    dropped: Queued | None  # the job dropped to make room (the new one when not queued), or None when none could be


class WriteQueue:
    """Thread-safe. `value(job)` is called under the queue's lock: it must be cheap and must not
    call the queue."""

    def __init__(self, bound: int | None, value: Callable[[Any], JobValue], max_bytes: int | None = None):
        self.bound = bound  # jobs; None: no bound by count
        self.max_bytes = max_bytes  # None: no bound by bytes
        self._value = value
        self._cond = threading.Condition()  # guards _items, _bytes, _closed, _seq
        self._items: deque[Queued] = deque()
        self._bytes = 0
        self._closed = False
        self._seq = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def _fits(self, nbytes: int) -> bool:
        """Lock held. Room for a job of `nbytes` (an empty queue always has room)."""
        if not self._items:
            return True
        if self.bound is not None and len(self._items) >= self.bound:
            return False
        return self.max_bytes is None or self._bytes + nbytes <= self.max_bytes

    def room_for(self, nbytes: int) -> bool:
        with self._cond:
            return self._fits(nbytes)

    def free_bytes(self) -> int:
        """Bytes that fit before the byte bound (0 when full by count)."""
        with self._cond:
            if self.bound is not None and len(self._items) >= self.bound:
                return 0
            return 2**62 if self.max_bytes is None else max(0, self.max_bytes - self._bytes)

    def _append(self, job: Any, nbytes: int) -> None:
        """Lock held."""
        self._seq += 1
        self._items.append(Queued(job, nbytes, self._seq))
        self._bytes += nbytes
        self._cond.notify_all()

    def put(self, job: Any, nbytes: int, timeout_s: float = 0.0) -> bool:
        """Queue `job` if there is room now or within `timeout_s`. False: still full."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._fits(nbytes):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._append(job, nbytes)
            return True

    def put_shedding(self, job: Any, nbytes: int) -> ShedResult:
        """Queue `job`, dropping the least valuable unpinned job (maybe `job` itself) if the queue is
        full. Never waits. When one dropped job did not make room (the byte bound, a bigger job), the
        result is (False, that job): call again (the new job may be the next one dropped)."""
        with self._cond:
            if self._fits(nbytes):
                self._append(job, nbytes)
                return ShedResult(True, None)
            new = Queued(job, nbytes, self._seq + 1)
            candidates = [new, *self._items]  # the newest first: it loses a tie
            victim = min(candidates, key=lambda q: (shed_order(self._value(q.job)), -q.seq))
            if self._value(victim.job).pinned:
                return ShedResult(False, None)
            if victim is new:
                return ShedResult(False, new)
            self._items.remove(victim)
            self._bytes -= victim.nbytes
            if not self._fits(nbytes):
                return ShedResult(False, victim)
            self._append(job, nbytes)
            return ShedResult(True, victim)

    def take(self, max_jobs: int, max_bytes: int) -> list[Queued]:
        """Up to `max_jobs` jobs, oldest first, within `max_bytes` (at least one job). Never waits."""
        with self._cond:
            out: list[Queued] = []
            total = 0
            while self._items and len(out) < max_jobs:
                if out and total + self._items[0].nbytes > max_bytes:
                    break
                item = self._items.popleft()
                self._bytes -= item.nbytes
                total += item.nbytes
                out.append(item)
            if out:
                self._cond.notify_all()  # room for a waiting put
            return out

    def wait(self, timeout_s: float) -> bool | None:
        """Wait until a job is queued or the queue is closed: True when a job is there, None when
        closed and empty (the writer ends), False after `timeout_s` with neither."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._items:
                if self._closed:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def put_all(self, items: list[tuple[Any, int]]) -> None:
        """Queue jobs the writer took back from RAM (it sized them to the room; never sheds)."""
        with self._cond:
            for job, nbytes in items:
                self._append(job, nbytes)

    def close(self) -> None:
        """No job is put after this (the writer's stop protocol ensures it); the writer drains and ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drop_all(self) -> list[Queued]:
        """Empty the queue; returns what it held (a drain cut short: the writer then ends)."""
        with self._cond:
            out = list(self._items)
            self._items.clear()
            self._bytes = 0
            self._cond.notify_all()
            return out

    def sort_by_value(self) -> None:
        """Most valuable first (pinned, then shallow; stable): a drain cut short by its time limit
        then leaves out the least valuable jobs."""
        with self._cond:
            self._items = deque(sorted(self._items, key=lambda q: shed_order(self._value(q.job)), reverse=True))


class Bandwidth:
    """Bytes per second over the last `window` batches that wrote something. Thread-safe."""

    def __init__(self, window: int = 16):
        self._lock = threading.Lock()  # guards _samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._samples.append((nbytes, seconds))

    def bytes_per_s(self) -> float | None:
        """None until a batch was measured."""
        with self._lock:
            seconds = sum(s for _, s in self._samples)
            return sum(b for b, _ in self._samples) / seconds if seconds else None
