"""Attention on the CPU without the scores it masks out, and with a vectorised softmax.

On a GPU (Metal, CUDA) MLX's fused attention skips the blocks of a causal mask that hide every key and
fuses the softmax; on the CPU `mx.fast.scaled_dot_product_attention` computes every query against every
key, masks, and runs a softmax whose `exp` costs ~15 ns per score (two thirds of a cold prefill's
attention: docs/benchmarks.md). Two remedies, each its own setting:

- Blocks ([generation] cpu_attention_rows): a chunk's queries are cut into blocks of `rows` and each block
  attends only to the keys up to its last query: the same result (each row's softmax over the same
  unmasked keys), ~0.65x of the attention time of a 470-token cold chunk on this CPU. It splits only what
  it can prove is causal: the mask "causal", or a boolean mask that hides every key after each query's own
  position (mlx-lm's `create_causal_mask`, with or without padding and windows, checked once per mask
  array); anything else (no mask, additive masks, a mask that lets a query see later keys) is one call.
- The softmax through NumPy ([generation] cpu_attention_softmax = "numpy"): MLX's own computation, step
  by step (scale, the scores' GEMM, the mask as MLX applies it, the weighted sum's GEMM), but the softmax
  of the evaluated scores in NumPy, whose `exp` is vectorised (~20x faster per score here), written over
  the scores in their own memory (a copy into and out of NumPy cost as much as the softmax); the mask
  "causal" is applied there too, to the only keys it can hide (the last `length`: a new question over a
  long context no longer masks every score). It needs the
  scores evaluated in the middle of the forward pass, so it is used only where that is allowed (not
  inside `mx.compile` or another transform: there MLX's op runs), where there are enough scores to pay
  for the stop (`NUMPY_MIN_SCORES`) and not so many that holding them whole weighs (`NUMPY_MAX_SCORES`);
  attention sinks are applied as MLX does, other options go to MLX's op.

Installed process-wide on the CPU (`install`), in place of MLX's op, which mlx-lm's models call through
`mlx_lm.models.base.scaled_dot_product_attention`. The outputs match MLX's to float rounding."""

from __future__ import annotations

import functools
import threading
from typing import Any

import mlx.core as mx
import numpy as np

MIN_ROWS = 64  # below this a block's GEMMs lose more than the skipped scores save
# Fewer scores than this (a decode step of a small batch) cost less in MLX than the evaluation stop
# the NumPy softmax needs (scripts/bench_cpu_attention.py).
NUMPY_MIN_SCORES = 16384
# More than this in one call (a long non-causal input, or a block over a very long context) goes to
# MLX's op: the NumPy softmax holds the whole scores in float32 (a copy of them for a half-precision
# model), 128 MiB at this bound.
NUMPY_MAX_SCORES = 1 << 25

_mlx_attention = mx.fast.scaled_dot_product_attention
_rows = 0  # query rows per block; 0 = no blocks
_numpy_softmax = False
_checked = threading.local()  # the last boolean mask checked (one per forward pass, every layer) and its verdict


def install(rows: int, softmax: str = "mlx") -> bool:
    """On the CPU, attention in blocks of `rows` query rows (0: none) and its softmax in NumPy when
    `softmax` is "numpy"; MLX's own op when neither (or off the CPU). Whether anything was installed."""
    global _rows, _numpy_softmax
    uninstall()
    if mx.default_device() != mx.cpu or (rows <= 0 and softmax != "numpy"):
        return False
    _rows = max(rows, MIN_ROWS) if rows > 0 else 0
    _numpy_softmax = softmax == "numpy"
    mx.fast.scaled_dot_product_attention = attention
    return True


def uninstall() -> None:
    global _rows, _numpy_softmax
    _rows, _numpy_softmax = 0, False
    mx.fast.scaled_dot_product_attention = _mlx_attention


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **kwargs: Any) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` as installed: in blocks where causal, softmax in NumPy."""
    return block_attention(q, k, v, scale=scale, mask=mask, rows=_rows, **kwargs)


def block_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any, rows: int, **kwargs: Any):
    """The attention of `q` in blocks of `rows` queries where `mask` is provably causal, else one call."""
    length, keys = q.shape[-2], k.shape[-2]
    if rows <= 0 or length < 2 * rows or keys < length or not _provably_causal(mask, length, keys):
        return _one_call(q, k, v, scale, mask, kwargs)
    offset, outs = keys - length, []
    for a in range(0, length, rows):
        b = min(a + rows, length)
        block_mask = mask if isinstance(mask, str) else mask[..., a:b, : offset + b]
        qb, kb, vb = q[..., a:b, :], k[..., : offset + b, :], v[..., : offset + b, :]
        outs.append(_one_call(qb, kb, vb, scale, block_mask, kwargs))
    return mx.concatenate(outs, axis=-2)


def _one_call(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any, kwargs: dict) -> mx.array:
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    sinks = kwargs.get("sinks")
    others = any(value is not None for key, value in kwargs.items() if key != "sinks")  # mlx-lm passes sinks=None
    if _numpy_softmax and not others and NUMPY_MIN_SCORES <= scores <= NUMPY_MAX_SCORES and _numpy_handles(mask, q, k):
        out = numpy_softmax_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
        if out is not None:
            return out
    return _mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)


def numpy_softmax_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
) -> mx.array | None:
    """MLX's attention (its CPU fallback's steps, grouped query heads, masks and attention sinks as it
    does them) with the softmax of the scores computed by NumPy, in place in the evaluated scores'
    own memory (no copy either way); None inside a transform (the scores cannot be evaluated there)."""
    batch, heads, length, dims = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    repeats = heads // kv_heads
    dtype = mx.result_type(q, k, v)
    # The query heads that share a KV head as one GEMM's rows: (batch, kv heads, repeats x length, dims).
    q = (mx.array(scale, dtype) * q.astype(dtype)).reshape(batch, kv_heads, repeats * length, dims)
    k, v = k.astype(dtype), v.astype(dtype)
    scores = (q @ k.swapaxes(-1, -2)).reshape(batch, kv_heads, repeats, length, keys)
    causal_tail = isinstance(mask, str) and keys >= length  # hidden in NumPy: only the last `length` keys
    if mask is not None and not causal_tail:
        if isinstance(mask, str):
            mask = (keys - length + mx.arange(length))[:, None] >= mx.arange(keys)[None]
        if mask.ndim >= 3:  # a mask per query head: per KV head and repeat, as the scores
            if mask.shape[-3] == 1:
                mask = mx.expand_dims(mask, -3)
            else:
                mask = mask.reshape(*mask.shape[:-3], kv_heads, repeats, *mask.shape[-2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(dtype)
    # A contiguous float32 array of its own (the GEMM's or the mask's result; a copy when the model's
    # dtype is another): nothing else holds its memory, so the softmax may overwrite it.
    scores = mx.contiguous(scores.astype(mx.float32))
    # A sink per query head: one more logit in each row's softmax, with no value (gpt-oss).
    sink = None if sinks is None else sinks.astype(dtype).astype(mx.float32).reshape(kv_heads, repeats, 1, 1)
    try:
        mx.eval(scores, sink)
    except ValueError:  # inside mx.compile / vmap / grad: no evaluation allowed
        return None
    view = np.asarray(scores)  # the scores' own memory, writable
    if causal_tail:
        hide_later_keys(view, keys - length)
    softmax_in_place(view, None if sink is None else np.asarray(sink))
    out = scores.astype(dtype).reshape(batch, kv_heads, repeats * length, keys) @ v
    return out.reshape(batch, heads, length, v.shape[-1])


def hide_later_keys(scores: np.ndarray, offset: int) -> None:
    """The causal mask, in place, on scores [..., queries, keys] whose query i sits at key `offset` + i:
    only the last `queries` keys hold keys later than some query (the lowest float32, as MLX's mask)."""
    np.copyto(scores[..., offset:], np.finfo(np.float32).min, where=_later_keys(scores.shape[-2]))


@functools.lru_cache(maxsize=8)
def _later_keys(length: int) -> np.ndarray:
    """[length, length]: True where key j comes after query i (every layer of a pass asks for the same)."""
    return np.triu(np.ones((length, length), dtype=bool), k=1)


def softmax_in_place(scores: np.ndarray, sink: np.ndarray | None = None) -> None:
    """softmax over the last axis of float32 `scores`, written over them (the largest score subtracted
    first, as MLX's precise one); with `sink`, each row's softmax has that logit too, and its share is
    left out of the result."""
    top = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink)
    np.subtract(scores, top, out=scores)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink - top)
    np.divide(scores, total, out=scores)


def _numpy_handles(mask: Any, q: mx.array, k: mx.array) -> bool:
    """Masks the NumPy path applies as MLX does: none, "causal", or an array broadcastable to the scores."""
    if mask is None or isinstance(mask, str):
        return mask is None or mask == "causal"
    if not isinstance(mask, mx.array) or mask.ndim > 4 or mask.shape[-1] != k.shape[-2]:
        return False
    return mask.ndim < 3 or mask.shape[-3] in (1, q.shape[1])


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
