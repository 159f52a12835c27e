"""Which admitted request starts next: cached-first with a bound on any request's wait.

A later turn of a conversation needs ~50-150 new tokens of prefill; a cold first turn needs
thousands. Prefilling the shortest uncached rest first (SGLang orders its waiting queue by the
longest cached prefix; shortest-job-first minimizes the mean wait) turns a later turn's wait from
"behind every cold prompt that arrived before it" into "next". So that cold requests never
starve, one that has waited `max_wait_s` goes before every request that has waited less (oldest
first). `fifo` keeps arrival order (distributed ranks use it: every rank must pick the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Candidate(Protocol):
    req: Any
    started: float  # when it arrived (perf_counter)
    seq: int  # arrival order


POLICIES = ("cached_first", "fifo")


@dataclass(frozen=True)
class StartOrder:
    policy: str = "cached_first"
    max_wait_s: float = 5.0  # past this wait a request goes first, whatever its prefill

    def pick(self, pending: Sequence[Candidate], uncached: Callable[[Any], int], now: float) -> Candidate:
        """The request to start now (`pending` is not empty). `uncached(req)`: the prompt tokens
        it would prefill; called only under cached_first."""
        overdue = [p for p in pending if now - p.started >= self.max_wait_s]
        if overdue or self.policy == "fifo" or len(pending) == 1:
            return min(overdue or pending, key=lambda p: p.seq)
        return min(pending, key=lambda p: (uncached(p.req), p.seq))
