"""One request's generation: prefill, decode, stop handling, events. Runs on the worker thread."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .request import Finished, GenerationRequest, TextDelta, Usage
from .stops import StopMatcher


class Generator:
    """Generates text for one request at a time with a loaded mlx-lm model and tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, prefill_step_size: int = 512):
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_step_size = prefill_step_size

    def run(self, req: GenerationRequest) -> None:
        """Generate for `req`, sending TextDelta events and one Finished event through req.emit.
        Exceptions propagate to the caller (the worker turns them into Failed events)."""
        started = time.perf_counter()
        params = req.params
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
        cache = make_prompt_cache(self.model)
        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopMatcher(params.stop)
        eos = set(self.tokenizer.eos_token_ids)
        first_token_s = 0.0
        num_generated, finish_reason = 0, "length"
        steps = generate_step(
            mx.array(req.prompt_tokens),
            self.model,
            max_tokens=params.max_tokens,
            sampler=sampler,
            prompt_cache=cache,
            prefill_step_size=self.prefill_step_size,
        )
        for token, _ in steps:
            if num_generated == 0:
                first_token_s = time.perf_counter() - started
            if req.cancelled.is_set():
                finish_reason = "cancelled"
                break
            if token in eos:
                finish_reason = "stop"
                break
            num_generated += 1
            detok.add_token(token)
            text = stops.feed(detok.last_segment)
            if text:
                req.emit(TextDelta(text, 1))
            if stops.stopped:
                finish_reason = "stop"
                break
        steps.close()
        if not stops.stopped and finish_reason != "cancelled":
            detok.finalize()
            tail = stops.feed(detok.last_segment)
            tail += "" if stops.stopped else stops.flush()
            if tail:
                req.emit(TextDelta(tail, 0))
        usage = Usage(len(req.prompt_tokens), num_generated, cached_tokens=0)
        req.emit(Finished(finish_reason, usage, first_token_s))
