"""RoPE positions shifted past a cache's length, for M-RoPE models (Qwen2-VL: the tokens after an
image sit at index + rope_delta; vision/qwen.py).

mlx-lm's batch (BatchKVCache) rotates each sequence's new tokens by its `offset`, which nothing
else reads (its mask comes from the write index and the left padding), and builds that offset
from each joining cache's length in the first cache's `merge`. So a cache that should continue at
length + delta gets a `merge` that adds every joining cache's delta. Kept apart from kv/blocks.py
(the module that builds caches, at its size limit); it imports none of mlx-lm's classes and only
wraps their `merge`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx


def shift_positions(prompt_cache: list[Any], delta: int) -> None:
    """Once this cache joins mlx-lm's batch, its next tokens are rotated at positions `delta` past
    its length. The batch merges its caches with the first one's `merge`, so every cache that joins
    a batch of this model needs the call (delta 0 for a text prompt). The cache's own offset, size
    and contents do not change (blocks cut from it are the same)."""
    for c in prompt_cache:
        c.rope_delta = delta
        c.merge = partial(_merge_shifted, type(c).merge)  # an instance attribute: this cache only


def _merge_shifted(merge: Any, caches: list[Any]) -> Any:
    batch = merge(caches)
    batch.offset = batch.offset + mx.array([getattr(c, "rope_delta", 0) for c in caches])
    return batch
