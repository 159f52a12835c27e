"""Writing blocks into an mlx-lm cache's arrays (the assembly's half of kv/blocks.py, which names
mlx-lm's cache classes; this module only follows their attributes: keys, values, offset, step, merge)
and a cache joining mlx-lm's batch alone around its own arrays.

- `fill_kv`: a fresh cache from the blocks' pieces, joined once per layer with room for the rest;
- `fill_direct`: a direct run's buffers (kv/runs.py), read from the SSD for this request, made the
  cache, the blocks RAM held and the tail written into them in place;
- `merge_alone`: the merge such a cache carries, so that alone it joins the batch without a copy.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from functools import partial
from typing import Any

import mlx.core as mx

from .concat import join_pair


def fill_kv(cache: Any, kv: Sequence[tuple[mx.array, mx.array]], tail_used: int, length: int, room: int) -> None:
    """Fill a full-attention cache with the (keys, values) of each block, the last one a tail of
    which only `tail_used` positions count (when `tail_used`)."""
    keys = [k for k, _ in kv]
    values = [v for _, v in kv]
    if tail_used:
        keys[-1], values[-1] = keys[-1][..., :tail_used, :], values[-1][..., :tail_used, :]
    if room > 0:
        spare = -(-(length + room) // cache.step) * cache.step - length
        k, v = keys[0], values[0]
        keys.append(mx.zeros((*k.shape[:2], spare, k.shape[3]), k.dtype))
        values.append(mx.zeros((*v.shape[:2], spare, v.shape[3]), v.dtype))
    cache.keys, cache.values = join_pair(keys, values)
    cache.offset = length
    cache.merge = partial(merge_alone, cache.merge)  # an instance attribute: this cache only


def fill_direct(
    cache: Any,
    buffers: tuple[mx.array, mx.array],
    pieces: Sequence[tuple[mx.array, mx.array]],
    lead: int,
    tail: tuple[mx.array, mx.array] | None,
    length: int,
    tail_used: int,
    room: int,
) -> None:
    """Make a direct run's buffers (keys, values) the cache: the pieces before its blocks (`lead`
    positions) and the tail's first `tail_used` positions (ending at `length`) written in place,
    one write each. The buffers stay the same objects (the run keeps them): mlx writes an array in
    place while nothing else shares it, so neither these writes nor the request's own copy the
    prefix. Buffers too short for `room` (not made for this request) are joined to a new size."""
    keys, values = buffers
    pos = 0
    for k, v in pieces:
        n = k.shape[2]
        keys[..., pos : pos + n, :] = k
        values[..., pos : pos + n, :] = v
        pos += n
    if pos != lead:
        raise ValueError(f"the blocks before a direct read hold {pos} positions, its buffers {lead}")
    if tail is not None:
        keys[..., length - tail_used : length, :] = tail[0][..., :tail_used, :]
        values[..., length - tail_used : length, :] = tail[1][..., :tail_used, :]
    if keys.shape[2] < length + room:
        fill_kv(cache, [(keys[..., :length, :], values[..., :length, :])], 0, length, room)
        return
    cache.keys, cache.values = keys, values
    cache.offset = length
    cache.merge = partial(merge_alone, cache.merge)  # an instance attribute: this cache only


def merge_alone(merge: Any, caches: list[Any]) -> Any:
    """mlx-lm's merge, but an assembled cache joining alone becomes a batch of one around its own
    arrays, room kept (mlx-lm copies the prefix to an exact-size array, then again to grow it)."""
    (c, *others) = caches
    if others or c.keys is None:
        return merge(caches)
    batch = merge([type(c)()])  # an empty batch cache of the class this cache's merge makes
    batch.__class__ = _moved_class(type(batch))
    batch.keys, batch.values, batch._idx = c.keys, c.values, c.offset
    batch.offset = mx.array([c.offset])
    return batch


@functools.cache
def _moved_class(base: type) -> type:
    """`base` whose whole batch moves to decoding without two copies: mlx-lm's split deep-copies the
    caches, then filters both halves (each filter replaces what it keeps): a shallow copy does, and
    keeping every row in order keeps the arrays."""

    def keep_rows(self: Any, batch_indices: Any) -> None:
        if list(batch_indices) != list(range(self.left_padding.shape[0])):
            base.filter(self, batch_indices)

    shallow = {"__deepcopy__": lambda self, memo: copy.copy(self), "filter": keep_rows}
    return type(f"Moved{base.__name__}", (base,), shallow)
