"""Prefill outside the batch: part of a request's prompt run on its own cache (its assembled prefix)
before it joins mlx-lm's BatchGenerator, which then takes the filled cache like a cached prefix.

- **Images**: a vision model's prompt is prefilled from input embeddings with the images merged in
  (vision/runtime.py), all but the last token; checkpoints on the way are captured.
- **A short rest beside a long prefill**: mlx-lm prefills the prompts in its batch together, one padded
  pass per chunk. A later turn with 20 new tokens joining while two cold prompts prefill was padded to
  their chunk (hundreds of tokens), cost that pass a whole extra row, and got its first token only when
  the pass ended (in process, 2 cold ~870-token prompts and 2 later turns: the later turns' TTFT 23.2 s,
  the cold ones' 33.2 s; prefilled alone: 0.75 s and 17.6 s). Prefilled alone first, it joins with only
  its last token left and decodes in the step it joins (engine/batch/mlx_batch.py). Such a rest now
  joins decoding directly with its first token (engine/batch/direct_join.py); this path takes those past
  that step's budget. Only for layouts that prefill several prompts together (no recurrent state),
  with no checkpoint to capture, on one machine (ranks must run the same passes).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx


def prefill_rest(sched: Any, req: Any, prepared: Any, cached: int, points: list[int]) -> tuple[int, list[int]]:
    """Prefill what of `req`'s prompt goes outside the batch (see above); returns the position its
    cache has reached and the checkpoints still ahead. `sched` is the engine's Scheduler."""
    if req.images and sched.vision is not None and sched.vision.needs_prefill(req.images, cached):
        reached = _timed(sched, cached, lambda: _vision(sched, req, prepared, cached, points))
        return reached, [p for p in points if p > reached]
    if _short_beside_long(sched, req, cached, points):
        return _timed(
            sched, cached, lambda: prefill_alone(sched.model, prepared.prompt_cache, req.prompt_tokens, cached)
        ), points
    return cached, points


def prefill_alone(model: Any, cache: list[Any], tokens: list[int], start: int) -> int:
    """Run tokens[start:-1] through `model` on `cache` (which holds tokens[:start]) in one pass and
    evaluate the cache; returns the position reached (len(tokens) - 1)."""
    stop = len(tokens) - 1
    if stop > start:
        model(mx.array(tokens[start:stop])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return max(start, stop)


def _short_beside_long(sched: Any, req: Any, cached: int, points: list[int]) -> bool:
    rest = len(req.prompt_tokens) - 1 - cached
    short = sched.short_prefill_tokens
    long_prefilling = any(
        not r.prefill_done and len(r.req.prompt_tokens) - r.prepared.match.num_tokens > short
        for r in sched._running.values()
    )
    return (
        sched.short_joins
        and 0 < rest <= short
        and long_prefilling
        and not points
        and not req.images
        and sched.prefix_cache.agree is None
    )


def _vision(sched: Any, req: Any, prepared: Any, cached: int, points: list[int]) -> int:
    cache = prepared.prompt_cache
    return sched.vision.prefill(
        sched.model,
        cache,
        req.prompt_tokens,
        req.images,
        cached,
        sched.prefill_step_size,
        points,
        lambda position: sched.prefix_cache.capture(prepared, cache, position),
    )


def _timed(sched: Any, cached: int, run: Any) -> int:
    """Run a prefill, counting its tokens and time in the scheduler's stats."""
    started = time.perf_counter()
    reached = run()
    sched.stats.prefill_tokens += reached - cached
    sched.stats.prefill_s += time.perf_counter() - started
    return reached
