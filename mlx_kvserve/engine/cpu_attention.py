"""Causal attention on the CPU without the scores it masks out.

On a GPU (Metal, CUDA) MLX's fused attention skips the blocks of a causal mask that hide every key; on
the CPU `mx.fast.scaled_dot_product_attention` computes every query against every key, then masks: a
prompt chunk of L tokens pays L x (offset + L) scores and their `exp`, half of which the mask throws
away (two thirds of a cold prefill's attention time is that `exp`: docs/benchmarks.md). Here a chunk's
queries are cut into blocks of `rows` and each block attends only to the keys up to its last query:
the same result (each row's softmax over the same unmasked keys; within 1e-6 in float32), ~0.65x of the
attention time of a 470-token cold chunk on this CPU (scripts/bench_cpu_attention.py).

Installed process-wide on the CPU ([generation] cpu_attention_rows, `install`), in place of MLX's op,
which mlx-lm's models call through `mlx_lm.models.base.scaled_dot_product_attention`. It splits only
what it can prove is causal: the mask "causal", or a boolean mask that hides every key after each
query's own position (mlx-lm's `create_causal_mask`, with or without padding and windows, checked once
per mask array); anything else (no mask, additive masks, a mask that lets a query see later keys) goes
to MLX's op unchanged."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx

MIN_ROWS = 64  # below this a block's GEMMs lose more than the skipped scores save

_mlx_attention = mx.fast.scaled_dot_product_attention
_rows = 0  # query rows per block; 0 = not installed
_checked = threading.local()  # the last boolean mask checked (one per forward pass, every layer) and its verdict


def install(rows: int) -> bool:
    """Use the block-causal attention on the CPU with `rows` query rows per block (0: MLX's own)."""
    global _rows
    if rows <= 0 or mx.default_device() != mx.cpu:
        uninstall()
        return False
    _rows = max(rows, MIN_ROWS)
    mx.fast.scaled_dot_product_attention = attention
    return True


def uninstall() -> None:
    global _rows
    _rows = 0
    mx.fast.scaled_dot_product_attention = _mlx_attention


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **kwargs: Any) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` with the masked-out key blocks of a causal chunk skipped."""
    return block_attention(q, k, v, scale=scale, mask=mask, rows=_rows, **kwargs)


def block_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any, rows: int, **kwargs: Any):
    """The attention of `q` in blocks of `rows` queries where `mask` is provably causal, else MLX's."""
    length, keys = q.shape[-2], k.shape[-2]
    if rows <= 0 or length < 2 * rows or keys < length or not _provably_causal(mask, length, keys):
        return _mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)
    offset, outs = keys - length, []
    for a in range(0, length, rows):
        b = min(a + rows, length)
        block_mask = mask if isinstance(mask, str) else mask[..., a:b, : offset + b]
        qb, kb, vb = q[..., a:b, :], k[..., : offset + b, :], v[..., : offset + b, :]
        outs.append(_mlx_attention(qb, kb, vb, scale=scale, mask=block_mask, **kwargs))
    return mx.concatenate(outs, axis=-2)


def _provably_causal(mask: Any, length: int, keys: int) -> bool:
    """Whether `mask` hides, from query i (at key position keys - length + i), every later key."""
    if isinstance(mask, str):
        return mask == "causal"
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.shape[-2:] != (length, keys):
        return False
    if getattr(_checked, "mask", None) is mask:
        return _checked.verdict
    offset = keys - length
    later = mx.arange(keys)[None] > (offset + mx.arange(length))[:, None]
    verdict = not bool(mx.any(mask & later).item())
    _checked.mask, _checked.verdict = mask, verdict
    return verdict
