"""Payloads: a block's (or tail's) per-layer arrays as kv/blocks.py defines them, and what can be
said about them without mlx-lm's cache classes (their arrays, their size, a window layer's pieces,
the dtype a model's KV arrays have).

A payload is a list with one entry per layer: `(keys, values)` of shape (1, heads, n, dim) for
attention layers (n = the block's or tail's positions; fewer, or None, for a window layer), a
tuple of state arrays (or None) for recurrent layers. Payload entries own their memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

Payload = list[Any]


def window_pieces(
    payloads: Sequence[Payload], tail: Payload | None, tail_used: int, tail_len: int, layer: int, block_size: int
) -> list[tuple[mx.array, mx.array]]:
    """The window layer's data ending at the prefix's end, contiguous, oldest first (stops at
    the first gap: positions before it are unusable)."""
    pieces = []
    if tail_used:
        entry = tail[layer] if tail is not None else None
        held = entry[0].shape[2] if entry is not None else 0
        missing = tail_len - held  # the entry is a suffix of the tail's positions
        if held == 0 or tail_used <= missing:
            return []
        k, v = entry
        used = tail_used - missing
        pieces.append((k[..., :used, :], v[..., :used, :]))
        if missing > 0:
            return pieces
    for payload in reversed(payloads):
        entry = payload[layer]
        if entry is None:
            break
        pieces.append(entry)
        if entry[0].shape[2] < block_size:  # a suffix of the block: nothing before it
            break
    return pieces[::-1]


def arrays_of(payloads: Sequence[Payload]) -> list[mx.array]:
    return [a for p in payloads for e in p if e is not None for a in e if isinstance(a, mx.array)]


def payload_nbytes(payload: Payload) -> int:
    return sum(a.nbytes for e in payload if e is not None for a in e if isinstance(a, mx.array))


def kv_dtype_of(model: Any) -> str:
    """The dtype of the model's activations, so of its KV (read from a norm layer's weight)."""
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "layernorm.weight")):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"
