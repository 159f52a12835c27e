"""Drive the engine's Scheduler directly (no server) with a fresh block cache: the stack is
harness.kvstack's (the benches use it too); these are the tests' own checks on it. `greedy` and
`final_logits` take that stack or an Engine's Scheduler alike (both `run`, with `model` and `prefix_cache`)."""

from __future__ import annotations

import mlx.core as mx
from harness.kvstack import OPEN_TIERS, KVStack, close_ssd, make_generator  # noqa: F401  (re-exported for the tests)

from mlx_kvserve.engine.batch.scheduler import Scheduler
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta


def greedy(generator: KVStack | Scheduler, prompt: list[int], max_tokens: int) -> tuple[tuple[int, ...], str, int]:
    """(completion token ids, text, cached tokens) of a greedy run through the engine."""
    events: list = []
    req = GenerationRequest("test", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), events.append)
    generator.run(req)
    done = events[-1]
    assert isinstance(done, Finished), events
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return done.token_ids, text, done.usage.cached_tokens


def final_logits(generator: KVStack | Scheduler, prompt: list[int]) -> tuple[mx.array, int]:
    """Logits after `prompt`, computed on top of whatever the block cache holds for it, plus the
    number of tokens served from cache. The cold reference is the same call on an empty cache."""
    prepared = generator.prefix_cache.prepare(prompt)
    try:
        cached = prepared.match.num_tokens
        logits = generator.model(mx.array(prompt[cached:])[None], cache=prepared.prompt_cache)[0, -1]
        mx.eval(logits)
        return logits.astype(mx.float32), cached
    finally:
        generator.prefix_cache.release(prepared)


def cold_logits(model, prompt: list[int]) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0, -1]
    mx.eval(logits)
    return logits.astype(mx.float32)
