"""What the SSD writer is handed and answers with: a WriteJob (one block or tail to save), the save
functions, the Backlog it refills its queue from, and a shutdown drain's estimate."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from .store import SaveResult

log = logging.getLogger("mlx_kvserve.kv.ssd.writer")  # the writer's lines, under its name
MIB = 1024 * 1024


class DrainEstimate(NamedTuple):
    num_jobs: int  # queued (the batch being saved not counted)
    nbytes: int  # queued, being saved and owed by the backlog
    bytes_per_s: float  # measured (or assumed before the first batch)
    asked_s: float  # the time the drain asks for: nbytes / bytes_per_s with a margin

    def limit_s(self, ceiling_s: float) -> float:
        """How long a shutdown waits for this drain: what it asks for, at most `ceiling_s`."""
        return max(0.0, min(ceiling_s, self.asked_s))


class WriteJob(NamedTuple):
    """What SSDStore.save_block needs; the arrays must already be evaluated (mx.eval). `depth`:
    the block's index in its chain (deep blocks are shed first under overload)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: Sequence[int]
    arrays: Mapping[str, Any]
    depth: int = 0


SaveFn = Callable[[bytes, bytes, Sequence[int], Mapping[str, Any]], SaveResult]
SaveBatchFn = Callable[[list[WriteJob]], list[SaveResult]]


def job_nbytes(job: WriteJob) -> int:
    return sum(getattr(a, "nbytes", 0) for a in job.arrays.values())


class Backlog(Protocol):
    """Writes owed beyond the queue (blocks shed from it that RAM still holds). Called on the writer thread."""

    def backlog_bytes(self) -> int:
        """About how many bytes `take_backlog` would still hand out (for the drain's estimate)."""
        ...

    def take_backlog(self, max_bytes: int) -> list[WriteJob]:
        """The next owed jobs, shallowest first, within `max_bytes` (at least one while any is owed);
        each is handed out once ([] when none is owed)."""
        ...


def log_drain(est: DrainEstimate, ceiling_s: float) -> None:
    log.info(
        "SSD writer: draining %d blocks, %.1f MiB, estimated %.1f s at %.0f MiB/s (limit %.1f s, ceiling %.1f s)",
        est.num_jobs,
        est.nbytes / MIB,
        est.nbytes / est.bytes_per_s,
        est.bytes_per_s / MIB,
        est.limit_s(ceiling_s),
        ceiling_s,
    )
    if est.asked_s > ceiling_s:
        log.warning(
            "SSD writer: the drain asks for %.1f s, more than its ceiling ([ssd] drain_timeout_s = %.1f): "
            "the least valuable blocks are queued last and may not be written",
            est.asked_s,
            ceiling_s,
        )


def log_dropped(waited_s: float, sizes: list[int], values: list[Any]) -> None:
    """The drain stopped at its limit: what it dropped, in one line (values: each job's JobValue)."""
    log.warning(
        "SSD writer: the drain stopped at its limit after %.1f s: %d queued blocks and tails (%.1f MiB) "
        "not written (%d pinned; chain depths %d-%d): they are recomputed when next asked",
        waited_s,
        len(sizes),
        sum(sizes) / MIB,
        sum(v.pinned for v in values),
        min(v.depth for v in values),
        max(v.depth for v in values),
    )
