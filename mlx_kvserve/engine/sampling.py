"""Per-request samplers for the batch. A seeded request gets its own PRNG key, so its output
depends only on its seed and its logits, never on what else runs in the batch (mlx-lm's server
switches batching off for seeded requests instead)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from .request import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def make_request_sampler(params: SamplingParams) -> Sampler | None:
    """The sampler for one request; None for greedy (the batch then takes one argmax for all its
    greedy requests)."""
    if params.temperature == 0:
        return None
    if params.seed is None:
        return make_sampler(params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    return _SeededSampler(params)


class _SeededSampler:
    """make_sampler's filters, then a categorical draw with this request's own key chain."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.key = mx.random.key(params.seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self.params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=keys[1])
