"""Generation over the block cache: the Generator owns the batch Scheduler (engine/batch/scheduler.py)
and runs one request to its end (tests, tools) or serves many through the worker."""

from __future__ import annotations

from typing import Any

from ..cache.prefix_cache import PrefixCache
from ..request import GenerationRequest
from .order import StartOrder
from .scheduler import Scheduler
from .state import SchedulerStats


class Generator:
    """A loaded mlx-lm model and tokenizer, the block cache, and the batch that runs requests."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prefix_cache: PrefixCache,
        prefill_step_size: int = 512,
        max_batch: int = 8,
        stats: SchedulerStats | None = None,
        order: StartOrder | None = None,
        prefill_batch_size: int = 0,
        max_pending: int = 0,
        short_prefill_tokens: int = 0,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.prefill_step_size = prefill_step_size
        self.scheduler = Scheduler(
            model,
            tokenizer,
            prefix_cache,
            prefill_step_size,
            max_batch,
            stats,
            order,
            prefill_batch_size,
            max_pending,
            short_prefill_tokens,
        )

    def run(self, req: GenerationRequest) -> None:
        """Generate for `req` alone, sending TextDelta events and one Finished (or Failed) event
        through req.emit, and register its KV blocks; returns when all of that is done. Only for
        callers on the thread that owns MLX while the worker is not serving."""
        scheduler = self.scheduler
        scheduler.admit(req)
        while scheduler.is_running(req):
            scheduler.step()
