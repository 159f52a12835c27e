"""Which admitted request starts next: cached-first with a bound on any request's wait.

A later turn of a conversation needs ~50-150 new tokens of prefill; a cold first turn needs
thousands. Prefilling the shortest uncached rest first (SGLang orders its waiting queue by the
longest cached prefix; shortest-job-first minimizes the mean wait) turns a later turn's wait from
"behind every cold prompt that arrived before it" into "next". So that cold requests never
starve, a request that later ones have been passing for `max_wait_s` (since the first one started
ahead of it) goes before every other, oldest first. The bound counts only the time it is passed
over, not its wait for room in the batch: a cold request queued behind a full batch for a minute has
waited for capacity, not because of the order, and a cached turn arriving then still goes first
(with an absolute bound, every cold request past it jumped ahead of every cached turn once the
batch was busy for `max_wait_s`: at 16 clients, cached turns waited behind a whole second round of
cold prefills). `fifo` keeps arrival order (distributed ranks use it: every rank must pick the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Candidate(Protocol):
    req: Any
    started: float  # when it arrived (perf_counter)
    seq: int  # arrival order
    passed_at: float | None  # when a later request first started ahead of it (None: never)


POLICIES = ("cached_first", "fifo")


@dataclass(frozen=True)
class StartOrder:
    policy: str = "cached_first"
    max_wait_s: float = 5.0  # passed over this long, a request goes first, whatever its prefill

    def overdue(self, p: Candidate, now: float) -> bool:
        return p.passed_at is not None and now - p.passed_at >= self.max_wait_s

    def pick(self, pending: Sequence[Candidate], uncached: Callable[[Any], int], now: float) -> Candidate:
        """The request to start now (`pending` is not empty). `uncached(req)`: the prompt tokens
        it would prefill; called only under cached_first. The caller marks `passed_at` on the
        earlier arrivals the pick passes (see `passed`)."""
        overdue = [p for p in pending if self.overdue(p, now)]
        if overdue or self.policy == "fifo" or len(pending) == 1:
            return min(overdue or pending, key=lambda p: p.seq)
        return min(pending, key=lambda p: (uncached(p.req), p.seq))

    @staticmethod
    def passed(pending: Sequence[Candidate], pick: Candidate, now: float) -> None:
        """Note that `pick` started ahead of the requests in `pending` that arrived before it."""
        for p in pending:
            if p.seq < pick.seq and p.passed_at is None:
                p.passed_at = now
