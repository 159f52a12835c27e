"""Blocks <-> mlx-lm prompt cache. The only module that knows mlx-lm's cache classes.

A block payload is a list with one (keys, values) pair per layer, each of shape
(1, kv_heads, block_size, head_dim), copied out of the cache so that it owns its memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

Payload = list[tuple[mx.array, mx.array]]


class CacheSupport(NamedTuple):
    supported: bool
    reason: str  # why block caching is off ("" when supported)
    kv_dtype: str


def cache_support(model: Any) -> CacheSupport:
    """Whether this model's cache is plain attention KV that can be cut into blocks."""
    cache = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in cache})
    if any(type(c) is not KVCache for c in cache):
        return CacheSupport(False, f"model cache is {', '.join(kinds)}, not plain attention KV", "")
    dtype = _kv_dtype(model)
    return CacheSupport(True, "", dtype)


def _kv_dtype(model: Any) -> str:
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "layernorm.weight")):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"


def cache_length(prompt_cache: list[Any]) -> int:
    return prompt_cache[0].offset if prompt_cache else 0


def slice_blocks(prompt_cache: list[KVCache], start: int, end: int, block_size: int) -> list[tuple[Payload, int]]:
    """Copy blocks start..end-1 (block indices) out of the cache: [(payload, nbytes)]."""
    out: list[tuple[Payload, int]] = []
    arrays: list[mx.array] = []
    for i in range(start, end):
        lo, hi = i * block_size, (i + 1) * block_size
        payload = [(mx.contiguous(c.keys[..., lo:hi, :]), mx.contiguous(c.values[..., lo:hi, :])) for c in prompt_cache]
        arrays.extend(a for pair in payload for a in pair)
        out.append(payload)
    mx.eval(arrays)
    return [(p, sum(k.nbytes + v.nbytes for k, v in p)) for p in out]


def slice_tokens(prompt_cache: list[KVCache], start: int, end: int) -> tuple[Payload, int]:
    """Copy token positions start..end-1 out of the cache (a partial block): (payload, nbytes)."""
    payload = [
        (mx.contiguous(c.keys[..., start:end, :]), mx.contiguous(c.values[..., start:end, :])) for c in prompt_cache
    ]
    mx.eval([a for pair in payload for a in pair])
    return payload, sum(k.nbytes + v.nbytes for k, v in payload)


def assemble(
    model: Any, payloads: list[Payload], tail: Payload | None = None, tail_tokens: int = 0, room: int = 0
) -> list[KVCache]:
    """A fresh prompt cache holding the given blocks in order, then the first `tail_tokens`
    positions of `tail` (empty list and no tail: an empty cache). With `room`, the cache's
    buffers have space for at least that many more tokens (rounded up to mlx-lm's 256-token
    step), so prefilling them writes in place instead of copying the whole prefix to grow."""
    prompt_cache = make_prompt_cache(model)
    if tail is not None and tail_tokens:
        payloads = [*payloads, [(k[..., :tail_tokens, :], v[..., :tail_tokens, :]) for k, v in tail]]
    if not payloads:
        return prompt_cache
    length = sum(p[0][0].shape[2] for p in payloads)
    for layer, cache in enumerate(prompt_cache):
        keys = [p[layer][0] for p in payloads]
        values = [p[layer][1] for p in payloads]
        if room > 0:
            spare = -(-(length + room) // cache.step) * cache.step - length
            k, v = keys[0], values[0]
            keys.append(mx.zeros((*k.shape[:2], spare, k.shape[3]), k.dtype))
            values.append(mx.zeros((*v.shape[:2], spare, v.shape[3]), v.dtype))
        cache.keys = mx.concatenate(keys, axis=2)
        cache.values = mx.concatenate(values, axis=2)
        cache.offset = length
    mx.eval([c.keys for c in prompt_cache] + [c.values for c in prompt_cache])
    return prompt_cache


def payload_to_arrays(payload: Payload) -> dict[str, mx.array]:
    """Named arrays for the SSD store: `<layer>.k` / `<layer>.v`."""
    out: dict[str, mx.array] = {}
    for layer, (k, v) in enumerate(payload):
        out[f"{layer}.k"], out[f"{layer}.v"] = k, v
    return out


def payload_from_arrays(arrays: dict[str, mx.array]) -> tuple[Payload, int]:
    """The inverse of payload_to_arrays: (payload, nbytes). Raises KeyError for a wrong layout."""
    num_layers = len(arrays) // 2
    payload = [(arrays[f"{i}.k"], arrays[f"{i}.v"]) for i in range(num_layers)]
    return payload, sum(k.nbytes + v.nbytes for k, v in payload)
