"""/health's verdict: "ok", "degraded" (still serving, with the problems listed) or "shutting_down".

The engine reports facts (its stats and threads); judging them is the server's business, so the
rules live here, next to the one flag the lifespan sets when shutdown begins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..engine.front import EngineFront
from ..engine.memory.device import memory_report

ERROR_WINDOW_S = 300.0  # SSD write errors within this long make the server degraded


class RecentGrowth:
    """A counter seen between /health calls: whether it grew within the last ERROR_WINDOW_S (the window
    starts at the call that sees it grow)."""

    def __init__(self, count: int = 0):
        self._count, self._grew_at = count, None

    def recent(self, count: int, now: float) -> bool:
        if count > self._count:
            self._count, self._grew_at = count, now
        return self._grew_at is not None and now - self._grew_at < ERROR_WINDOW_S


class HealthMonitor:
    """`shutting_down` is set by the app's lifespan before it stops the engine (event loop only)."""

    def __init__(self, engine: EngineFront, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.shutting_down = False
        self._clock = clock
        self._write_errors = RecentGrowth()  # SSD write errors (blocks and tails)
        self._low_space = RecentGrowth()  # writes skipped for the free-space floor
        # requests failed for want of memory; those before this server are not its problem
        self._out_of_memory = RecentGrowth(memory_report()["requests_failed_out_of_memory"])

    def problems(self, cache: dict[str, Any]) -> list[str]:
        """What is wrong now, each in a sentence; [] when healthy. `cache` is engine.cache_stats()."""
        engine, found = self.engine, []
        if not engine.is_alive:
            found.append("the inference worker thread is not running")
        ssd_problem = engine.ssd_problem()
        if ssd_problem:
            found.append(ssd_problem)
        # Each failed write attempt counts once: the store counts it (blocks and tails); the writer's
        # `writer_failures` counts the same failures again per job, so it is not added.
        num_errors = cache.get("ssd_errors", 0) + cache.get("ssd_tail_write_errors", 0)
        num_low_space = cache.get("ssd_skipped_low_space", 0) + cache.get("ssd_tail_skipped_low_space", 0)
        now = self._clock()
        if self._write_errors.recent(num_errors, now):
            found.append(
                f"SSD writes are failing ({num_errors} errors since start, the last within {ERROR_WINDOW_S:.0f}s)"
            )
        if self._low_space.recent(num_low_space, now):
            found.append(
                f"the SSD cache's disk is below its free-space floor ([ssd] min_free_bytes): {num_low_space} "
                f"writes skipped since start, the last within {ERROR_WINDOW_S:.0f}s"
            )
        return found

    def memory_problems(self, memory: dict[str, Any]) -> list[str]:
        """Requests failed for want of memory (engine/memory/device.py) within the error window."""
        count = memory.get("requests_failed_out_of_memory", 0)
        if not self._out_of_memory.recent(count, self._clock()):
            return []
        return [
            f"requests failed for want of memory ({count} since start, the last within {ERROR_WINDOW_S:.0f}s: "
            f"{memory.get('last_out_of_memory')}); /health memory shows what holds it"
        ]

    def report(self) -> tuple[dict[str, Any], int]:
        """(/health body, HTTP status): 503 while shutting down, else 200."""
        body = self.engine.health()
        memory = body.setdefault("memory", memory_report())
        if self.shutting_down:
            body["status"], body["problems"] = "shutting_down", []
            return body, 503
        fatal = self.fatal(body.get("cache", {}))
        if fatal:  # distributed: the ranks cannot run a step together any more
            body["status"], body["problems"] = "unavailable", fatal
            return body, 503
        problems = self.problems(body.get("cache", {})) + self.memory_problems(memory)
        body["status"], body["problems"] = ("degraded" if problems else "ok"), problems
        return body, 200

    def fatal(self, cache: dict[str, Any]) -> list[str]:
        """Why no request can be served at all (distributed: a rank died or does not answer)."""
        found = []
        failed = self.engine.failure
        if failed:
            found.append(failed)
        if cache.get("ranks_error"):
            found.append(f"the other ranks do not answer: {cache['ranks_error']}")
        return found
