"""One request's generation: prefill, decode, stop handling, events. Runs on the worker thread."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from .prefix_cache import PrefixCache
from .request import Finished, GenerationRequest, TextDelta, Usage
from .stops import StopMatcher


class Outcome(NamedTuple):
    finish_reason: str
    num_tokens: int  # completion tokens sent to the client (eos not counted)
    first_token_s: float


class Generator:
    """Generates text for one request at a time with a loaded mlx-lm model and tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, prefix_cache: PrefixCache, prefill_step_size: int = 512):
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.prefill_step_size = prefill_step_size

    def run(self, req: GenerationRequest) -> None:
        """Generate for `req`, sending TextDelta events and one Finished event through req.emit,
        then register the new KV blocks. Exceptions propagate (the worker sends them as Failed)."""
        started = time.perf_counter()
        prepared = self.prefix_cache.prepare(req.prompt_tokens)
        generated: list[int] = []
        try:
            outcome = self._decode(req, prepared.prompt_cache, prepared.match.num_tokens, generated, started)
        except BaseException:
            self.prefix_cache.release(prepared)
            raise
        try:
            usage = Usage(len(req.prompt_tokens), outcome.num_tokens, prepared.match.num_tokens)
            completion = tuple(generated[: outcome.num_tokens])
            req.emit(Finished(outcome.finish_reason, usage, outcome.first_token_s, completion))
        finally:  # registers the new blocks and releases the request's references
            self.prefix_cache.finish(prepared, req.prompt_tokens + generated, len(req.prompt_tokens))

    def _decode(
        self, req: GenerationRequest, cache: list, cached: int, generated: list[int], started: float
    ) -> Outcome:
        """Prefill the uncached rest of the prompt and decode. Appends every sampled token to
        `generated` (eos included: the cache holds its KV once the next step ran)."""
        params = req.params
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopMatcher(params.stop)
        eos = set(self.tokenizer.eos_token_ids)
        first_token_s = 0.0
        num_generated, finish_reason = 0, "length"
        steps = generate_step(
            mx.array(req.prompt_tokens[cached:]),
            self.model,
            max_tokens=params.max_tokens,
            sampler=sampler,
            prompt_cache=cache,
            prefill_step_size=self.prefill_step_size,
        )
        for token, _ in steps:
            generated.append(token)
            if num_generated == 0:
                first_token_s = time.perf_counter() - started
                self.prefix_cache.first_token()
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
        return Outcome(finish_reason, num_generated, first_token_s)
