"""A short rest's first token from its own prefill: the request joins the batch already decoding.

mlx-lm's batch holds a prompt's last token back: the prompt batch prefills the rest, a later step
moves the request to the decode batch, and the move runs the last token through the model alone
(`GenerationBatch.__init__` steps once) before the next decode pass reports the first token. A
later turn of a conversation (tens of new tokens on a cached prefix) thus waited for two batch steps
and three passes: the step that prefilled its rest (after the running requests' decode pass), then
the step that moved it (the one-token pass of its own). On the CPU with 4 clients that was ~1 s of a
later turn's ~1.2 s inside the server (docs/benchmarks-history-2026-12-07.md "A later turn's first token from its own
prefill").

Here a request whose uncached rest is short (at most `short_prefill_tokens`, the last token
included) is prefilled on its own cache in one pass, last token included, before the step's decode
pass; its first token is sampled from that pass's last logits (its own logits processors and
sampler, on the prompt as their context), and it enters mlx-lm's decode batch with that token as
its next input, as if the batch had sampled it: the step's decode pass reports it and computes the
second. What the prompt batch would have done for it (its KV, its tokens) is the same; its cache is
its assembled prefix, joined without a copy (kv/cache_fill.py `merge_alone`). The first token's text
goes to the client as soon as it is sampled (Scheduler._send_ahead), not after that decode pass: a
later turn's first token no longer waits for the running requests' next token.

Only where the batch prefills prompts together (no recurrent state), with no checkpoint or image on
the way, on one machine (ranks must run the same passes); at most `prefill_step_size` tokens of such
joins per step (the others take the batch's prompt step), so a burst of later turns costs the
running requests' next token no more than one chunk would.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def fits(rest: int, room: int, plain: bool) -> bool:
    """Whether a request whose uncached rest is `rest` tokens (its last included) joins decoding
    directly: `room` tokens of direct joins are left this step (at most short_prefill_tokens), and
    `plain` says nothing stands in the way (see above: the batch prefills prompts together, no
    checkpoint or image on the way, one machine). The scheduler asks (Scheduler._start)."""
    return plain and 0 < rest <= room


def first_token(model: Any, cache: list[Any], tokens: list[int], start: int, sampler: Any, processors: list[Any]):
    """Run tokens[start:] through `model` on `cache` (which holds tokens[:start]) in one pass and
    sample the next token from the last position's logits: (token [1], its log-probabilities [1, V]),
    evaluated with the cache."""
    logits = model(mx.array(tokens[start:])[None], cache=cache)[:, -1, :]
    if processors:
        context = mx.array(tokens, dtype=mx.int32)
        for processor in processors:
            logits = processor(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = sampler(logprobs)
    mx.eval(token, logprobs, [c.state for c in cache])
    return token, logprobs
