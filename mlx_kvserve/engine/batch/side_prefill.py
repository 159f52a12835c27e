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

The scheduler decides and runs both (Scheduler._prefill_rest); here are the pure parts.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def short_beside_long(rest: int, short: int, long_prefilling: bool, plain: bool) -> bool:
    """Whether a rest of `rest` tokens (all but the prompt's last) is prefilled alone before it
    joins: it is short (at most `short`), a long prompt is prefilling in the batch, and `plain`
    says nothing stands in the way (no checkpoint or image, prompts prefilled together, one machine)."""
    return plain and long_prefilling and 0 < rest <= short


def prefill_alone(model: Any, cache: list[Any], tokens: list[int], start: int) -> int:
    """Run tokens[start:-1] through `model` on `cache` (which holds tokens[:start]) in one pass and
    evaluate the cache; returns the position reached (len(tokens) - 1)."""
    stop = len(tokens) - 1
    if stop > start:
        model(mx.array(tokens[start:stop])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return max(start, stop)
