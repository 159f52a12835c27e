"""Payloads: a block's (or tail's) per-layer arrays as kv/blocks.py defines them, and what can be
said about them without mlx-lm's cache classes (the layer kinds, their arrays, their size, a window
layer's pieces, the dtype a model's KV arrays have, their names in the SSD store).

A payload is a list with one entry per layer: `(keys, values)` of shape (1, heads, n, dim) for
attention layers (n = the block's or tail's positions; fewer, or None, for a window layer), a
tuple of state arrays (or None) for recurrent layers. Payload entries own their memory, or are
views of their run: one copy of the blocks registered together (kv/runs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .ssd.format import kv_names, quantized_kv_names, state_name

Payload = list[Any]
KV, WINDOW, STATE, IDLE = "kv", "window", "state", "idle"


@dataclass(frozen=True)
class LayerSpec:
    kind: str  # KV, WINDOW, STATE or IDLE
    window: int = 0  # WINDOW: the window's size in positions
    state_size: int = 0  # STATE: how many arrays the state has


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


def payload_to_arrays(specs: Sequence[LayerSpec], payload: Payload) -> dict[str, mx.array]:
    """Named arrays for the SSD store (names: kv/ssd/format.py): keys and values, quantized or
    not, and the arrays of recurrent states."""
    out: dict[str, mx.array] = {}
    for i, (spec, entry) in enumerate(zip(specs, payload, strict=True)):
        if entry is None:
            continue
        if spec.kind == STATE:
            for j, a in enumerate(entry):
                out[state_name(i, j)] = a
        elif len(entry) == 4:  # quantized keys and values
            kq, ke, vq, ve = quantized_kv_names(i)
            out[kq], out[ke], out[vq], out[ve] = entry
        else:
            k, v = kv_names(i)
            out[k], out[v] = entry
    return out


def payload_from_arrays(specs: Sequence[LayerSpec], kv_bits: int, arrays: dict[str, mx.array]) -> tuple[Payload, int]:
    """The inverse of payload_to_arrays: (payload, nbytes). Raises KeyError for a wrong layout."""
    payload: Payload = []
    for i, spec in enumerate(specs):
        if spec.kind == KV and kv_bits:
            payload.append(tuple(arrays[n] for n in quantized_kv_names(i)))
        elif spec.kind == KV:
            payload.append(tuple(arrays[n] for n in kv_names(i)))
        elif spec.kind == WINDOW:
            k, v = kv_names(i)
            payload.append((arrays[k], arrays[v]) if k in arrays else None)
        elif spec.kind == IDLE:
            payload.append(None)
        else:
            names = [state_name(i, j) for j in range(spec.state_size)]
            payload.append(tuple(arrays[n] for n in names) if names[0] in arrays else None)
    expected = sum(len(e) if e is not None else 0 for e in payload)
    if expected != len(arrays):
        raise KeyError(f"{len(arrays)} arrays where the layout has {expected}")
    return payload, payload_nbytes(payload)
