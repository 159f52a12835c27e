"""Turns between the engines of one process (the models of a registry, registry/registry.py): with a
StepTurns shared by their workers, each engine runs its batch steps (a decode step, a prefill chunk) one
at a time with the others', in the order they asked (a ticket queue), so a small model's step waits for
at most the one step of a large model that is running.

Off by default (ModelRegistry.turns is None): measured by scripts/bench_models.py, a small model's first
token needs two of its steps, and each then waits for a whole prefill chunk of the large one — slower
than letting both threads run (on the CPU 56-75x its TTFT alone against 7-23x; on an H200 10.9x against
5.6x; docs/benchmarks.md "Several models"). It stays as the hook a finer scheduler would use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepTurns:
    """A fair (FIFO) turn for each batch step of every engine sharing it. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # guards _next_ticket, _serving and the counters
        self._next_ticket = 0
        self._serving = 0
        self.num_turns = 0
        self.num_waits = 0  # turns that had to wait for another engine's step

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for one step: returns once every step that asked before is done."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            self.num_turns += 1
            if ticket != self._serving:
                self.num_waits += 1
            while ticket != self._serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


def share_turns(engine: object, turns: StepTurns | None) -> None:
    """Make `engine`'s worker take `turns` (None: none) from its next step; an engine without an
    InferenceWorker (an embedding model, a test double) is left as it is."""
    worker = getattr(engine, "worker", None)
    if worker is not None and hasattr(worker, "turns"):
        worker.turns = turns
