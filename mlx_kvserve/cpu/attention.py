"""MLX's attention on the CPU with its softmax in NumPy, where that wins (issue 44's measurements).

On a GPU (Metal, CUDA) MLX's fused attention skips the blocks of a causal mask that hide every key and
fuses the softmax; on the CPU `mx.fast.scaled_dot_product_attention` computes every query against every
key, masks, and runs a softmax whose `exp` costs ~15 ns per score. This replacement (`install`) does
MLX's own steps (scale, the scores' GEMM, the mask as MLX applies it, the weighted sum's GEMM) but the
softmax of the evaluated scores in NumPy, whose `exp` is vectorised (~20x faster per score here), written
over the scores in their own memory; where the mask is provably causal (the mask "causal", or a boolean
mask that hides every key after each query's own position), a chunk's queries go in blocks of `rows`,
each against the keys up to its last query, so the scores the mask hides are not computed and a block's
scores stay within `NUMPY_MAX_SCORES`. Outputs match MLX's to float rounding.

Where it wins, per call, by shape (scripts/bench_cpu_attention_shapes.py, docs/benchmarks-history-2026-12-07.md): with at
least `NUMPY_MIN_SCORES` scores (query heads x query rows x keys) and blocks within `NUMPY_MAX_SCORES`,
everywhere measured: 0.13-0.96x of MLX's time, median 0.43x, over 1-32 heads x 16-128 dims, decode steps,
cached turns and cold chunks over 512-32k keys; below (a decode step over a short context) MLX's op is as
fast and needs no evaluation stop; above, MLX's op runs whole. Blocks with MLX's own softmax did not win
(0.6-1.6x, median 1.0x) and are not offered.

Where it loses, by model: the NumPy softmax needs the scores evaluated in the middle of the forward pass,
so it computes attentions MLX would never compute: a prefill chunk evaluates only the cache, and the last
layer's attention feeds nothing but the chunk's unread logits. That is 1/layers of the work; at 0.2-0.5x
per call it wins from 2 layers, and made a one-layer model's cold prompt 3-9x slower. `install` takes the
model's layer count for that reason. (Keeping it for a one-layer model's calls shorter than a prefill chunk,
which are mostly read, lost too: the prefill also stops at message starts, whose short chunks are unread.)

Installed process-wide by the CLI (cli.py) in place of MLX's op, which mlx-lm's models call through
`mlx_lm.models.base.scaled_dot_product_attention`; never inside `mx.compile` or another transform."""

from __future__ import annotations

import functools
import threading
from typing import Any

import mlx.core as mx
import numpy as np

MIN_ROWS = 64  # below this a block's GEMMs lose more than the skipped scores save
MIN_LAYERS = 2  # fewer: the unread last layer's attention is all of it (see above)
# Fewer scores than this (a decode step of a small batch) cost as much in MLX as the evaluation stop
# the NumPy softmax needs (scripts/bench_cpu_attention_shapes.py).
NUMPY_MIN_SCORES = 16384
# More than this in one call (a long non-causal input, or a block over a very long context) goes to
# MLX's op: the NumPy softmax holds the whole scores in float32 (a copy of them for a half-precision
# model), 128 MiB at this bound.
NUMPY_MAX_SCORES = 1 << 25

_mlx_attention = mx.fast.scaled_dot_product_attention
_rows = 0  # query rows per block; 0 = no blocks
_checked = threading.local()  # the last boolean mask checked (one per forward pass, every layer) and its verdict


def wins(num_layers: int | None, softmax: str = "numpy") -> bool:
    """Whether the replacement is worth installing for a model of `num_layers` layers (None: not known
    yet, as for several) on this device."""
    several = num_layers is None or num_layers >= MIN_LAYERS
    return mx.default_device() == mx.cpu and softmax == "numpy" and several


def install(rows: int, softmax: str = "numpy", num_layers: int | None = None) -> bool:
    """MLX's attention replaced by `attention` (the NumPy softmax, blocks of `rows` query rows where
    causal; 0: no blocks) where `wins` says so; otherwise MLX's own op. Whether it was installed."""
    global _rows
    uninstall()
    if not wins(num_layers, softmax):
        return False
    _rows = max(rows, MIN_ROWS) if rows > 0 else 0
    mx.fast.scaled_dot_product_attention = attention
    return True


def uninstall() -> None:
    global _rows
    _rows = 0
    mx.fast.scaled_dot_product_attention = _mlx_attention


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **kwargs: Any) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` as installed: the NumPy softmax where it wins, else MLX's op."""
    if q.shape[-2] > 1:  # a decode step's mask hides nothing the NumPy path could skip: no check, no sync
        mask = _as_causal(mask, q.shape[-2], k.shape[-2])
    return block_attention(q, k, v, scale=scale, mask=mask, rows=_rows, **kwargs)


def block_rows(heads: int, length: int, keys: int, rows: int) -> int:
    """Query rows per block for a causal call (0: one call): `rows`, fewer where the last block's
    scores would pass NUMPY_MAX_SCORES, none when that leaves fewer than MIN_ROWS or one block."""
    fit = min(rows, NUMPY_MAX_SCORES // max(heads * keys, 1))
    return fit if rows > 0 and fit >= MIN_ROWS and length >= 2 * fit else 0


def block_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any, rows: int, **kwargs: Any):
    """The attention of `q`, in blocks of up to `rows` queries where `mask` is provably causal."""
    batch, heads, length = q.shape[:3]
    keys = k.shape[-2]
    rows = block_rows(batch * heads, length, keys, rows) if keys >= length else 0
    if rows == 0 or not _provably_causal(mask, length, keys):
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
    if not others and NUMPY_MIN_SCORES <= scores <= NUMPY_MAX_SCORES and _numpy_handles(mask, q, k):
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
    return isinstance(mask, str) and mask == "causal" or _mask_verdict(mask, length, keys)[0]


def _as_causal(mask: Any, length: int, keys: int) -> Any:
    """The mask "causal" for a boolean mask that is exactly the causal mask (mlx-lm's batch cache without padding
    makes one): the NumPy softmax then hides only the last `length` keys instead of masking every score."""
    return "causal" if _mask_verdict(mask, length, keys)[1] else mask


def _mask_verdict(mask: Any, length: int, keys: int) -> tuple[bool, bool]:
    """(hides every later key, is exactly the causal mask) for a boolean mask of [..., length, keys]."""
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.shape[-2:] != (length, keys):
        return False, False
    if getattr(_checked, "mask", None) is mask:
        return _checked.verdict
    later = mx.arange(keys)[None] > (keys - length + mx.arange(length))[:, None]
    hides, exact = mx.logical_not(mx.any(mask & later)), mx.all(mask == mx.logical_not(later))
    mx.eval(hides, exact)
    verdict = (hides.item(), exact.item())
    _checked.mask, _checked.verdict = mask, verdict
    return verdict
