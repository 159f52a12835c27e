"""/health's verdict: "ok", "degraded" (still serving, with the problems listed) or "shutting_down".

The engine reports facts (its stats and threads); judging them is the server's business, so the
rules live here, next to the one flag the lifespan sets when shutdown begins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..engine.device_memory import memory_report

ERROR_WINDOW_S = 300.0  # SSD write errors within this long make the server degraded


class HealthMonitor:
    """`shutting_down` is set by the app's lifespan before it stops the engine (event loop only)."""

    def __init__(self, engine: Any, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.shutting_down = False
        self._clock = clock
        self._num_errors = 0  # SSD write errors (blocks and tails) when last seen
        self._last_error_at: float | None = None
        self._num_low_space = 0  # writes skipped for the free-space floor when last seen
        self._last_low_space_at: float | None = None
        self._num_out_of_memory = memory_report()["requests_failed_out_of_memory"]  # before this server
        self._last_out_of_memory_at: float | None = None

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
        if num_errors > self._num_errors:
            self._num_errors, self._last_error_at = num_errors, now
        if num_low_space > self._num_low_space:
            self._num_low_space, self._last_low_space_at = num_low_space, now
        if self._last_error_at is not None and now - self._last_error_at < ERROR_WINDOW_S:
            found.append(
                f"SSD writes are failing ({num_errors} errors since start, the last within {ERROR_WINDOW_S:.0f}s)"
            )
        if self._last_low_space_at is not None and now - self._last_low_space_at < ERROR_WINDOW_S:
            found.append(
                f"the SSD cache's disk is below its free-space floor ([ssd] min_free_bytes): {num_low_space} "
                f"writes skipped since start, the last within {ERROR_WINDOW_S:.0f}s"
            )
        return found

    def memory_problems(self, memory: dict[str, Any]) -> list[str]:
        """Requests failed for want of memory (engine/device_memory.py) within the error window."""
        count, now = memory.get("requests_failed_out_of_memory", 0), self._clock()
        if count > self._num_out_of_memory:
            self._num_out_of_memory, self._last_out_of_memory_at = count, now
        if self._last_out_of_memory_at is None or now - self._last_out_of_memory_at >= ERROR_WINDOW_S:
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
