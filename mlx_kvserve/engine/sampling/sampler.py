"""Per-request samplers for the batch. A seeded request gets its own PRNG key, so its output
depends only on its seed and its logits, never on what else runs in the batch (mlx-lm's server
switches batching off for seeded requests instead); the others draw from MLX's global key.
Per-request logits processors (logit_bias, OpenAI's penalties) run before the sampler, greedy
requests included.

A request's failure is its own: `RequestFault` wraps its sampler and logits processors so that
what they raise is kept for the scheduler, which fails that request after the step, instead of
failing mlx-lm's step and with it every request in the batch.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, categorical_sampling

from ..request import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[Any, mx.array], mx.array]


def make_request_sampler(params: SamplingParams) -> Sampler | None:
    """The sampler for one request; None for greedy (the batch then takes one argmax for all its
    greedy requests)."""
    if params.temperature == 0:
        return None
    return _RequestSampler(params)


def filtered(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """make_sampler's filters in its order (top_p, min_p, top_k); a top_k at or above the width
    of the logits keeps every token."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


class _RequestSampler:
    """make_sampler's filters in its order, then a categorical draw: with this request's own key
    chain when it has a seed, else with MLX's global key. A top_k at or above the width of the
    logits keeps every token (mlx-lm raises for it)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.key = None if params.seed is None else mx.random.key(params.seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self.params
        logprobs = filtered(logprobs, p)
        if self.key is None:
            return categorical_sampling(logprobs, p.temperature)
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=keys[1])


def make_request_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The request's logit_bias and penalty processors, in that order; empty when it asks for
    neither. A grammar's processor goes after them: it has the last word on what may be sampled."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(_LogitBias(params.logit_bias))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(_Penalties(params.presence_penalty, params.frequency_penalty))
    return processors


class _LogitBias:
    """Adds each token's bias to its logit (mlx-lm's logit_bias processor, with a bounds check:
    MLX does not check indices, and a token id past the logits would write elsewhere)."""

    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.max_id = max(token for token, _ in bias)
        self.ids = mx.array([token for token, _ in bias])
        self.values = mx.array([value for _, value in bias])

    def __call__(self, tokens: Any, logits: mx.array) -> mx.array:
        if self.max_id >= logits.shape[-1]:
            raise ValueError(f"logit_bias names token {self.max_id}; the model scores {logits.shape[-1]} tokens")
        return logits.at[:, self.ids].add(self.values.astype(logits.dtype))


class _Penalties:
    """OpenAI's presence and frequency penalties: logit -= presence * (count > 0) + frequency *
    count, counted over the tokens this completion generated so far. mlx-lm's own penalty
    processors count the last 20 tokens of the context, prompt included. The context mlx-lm passes
    is the prompt, then each sampled token: at the first call (sampling the completion's first
    token) it is the prompt alone."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency
        self.num_prompt: int | None = None

    def __call__(self, tokens: Any, logits: mx.array) -> mx.array:
        if self.num_prompt is None:
            self.num_prompt = len(tokens)
        generated = tokens[self.num_prompt :]
        if generated.size == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), mx.float32).at[generated].add(1.0)
        penalty = self.frequency * counts + self.presence * (counts > 0)
        return logits - penalty.astype(logits.dtype)


class RequestFault:
    """The first exception one request's sampler or logits processors raised (`error`; None while
    none has). Their wrapped versions never raise: after a failure they return a stand-in (the
    argmax token, the logits unchanged) so the batch's step completes, and the scheduler then
    takes the request out of the batch with its error."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def sampler(self, inner: Sampler | None) -> Sampler | None:
        """`inner`, contained; None stays None (greedy: the batch's shared argmax)."""
        if inner is None:
            return None

        def sample(logprobs: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return inner(logprobs)
                except Exception as exc:
                    self._fail(exc)
            return mx.argmax(logprobs, axis=-1)

        return sample

    def processor(self, inner: LogitsProcessor) -> LogitsProcessor:
        """`inner`, contained."""

        def process(tokens: Any, logits: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return inner(tokens, logits)
                except Exception as exc:
                    self._fail(exc)
            return logits

        return process

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        repair_random_state()


def repair_random_state() -> bool:
    """Re-seed MLX's global PRNG key if it cannot be evaluated; whether it had to. mlx-lm compiles
    its sampling filters with that key as an input and output: one that raises while being traced
    leaves a placeholder in its place, and every unseeded draw after it fails ("Attempting to eval
    an array without a primitive"). On the thread that owns MLX only."""
    try:
        mx.eval(list(mx.random.state))
        return False
    except Exception:
        mx.random.seed(secrets.randbits(63))  # fresh entropy: unseeded draws stay unpredictable
        log.warning("MLX's global random key was left unusable by a failed sampler; re-seeded it")
        return True


def token_logprobs(params: SamplingParams, token: int, logprobs: mx.array) -> tuple[TokenLogprob, ...]:
    """The sampled token's logprob and the `top_logprobs` most likely alternatives, when asked for."""
    if not (params.logprobs or params.top_logprobs):
        return ()
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        n = min(params.top_logprobs, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
        values = logprobs[ids]
        top = tuple(sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: -p[1]))
    return (TokenLogprob(token, logprobs[token].item(), top),)
