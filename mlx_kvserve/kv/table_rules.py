"""The SSD's table rules for a model (kv/ssd/table_check.py), read off one token's block.

One token goes through the model into a fresh cache, and the layout cuts that position out as a
tail with its recurrent states: its named arrays give every array's name, dtype and shape, the
token axis then free up to the block size. The same code that writes blocks makes the probe, so
the rules follow the layout (kv_bits, window and recurrent layers, pipeline ranks) by themselves.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .payloads import KV, STATE
from .ssd.table_check import TOKEN_AXIS, ArrayRule, TableExpectation, layer_of


def table_expectation(layout: Any) -> TableExpectation:
    """The rules for `layout`'s (kv/blocks.py's CacheLayout) blocks and tails. Runs the model on
    one token: every rank of a distributed model must call it together, like a forward."""
    cache = layout.new_cache()
    mx.eval(layout.model(mx.array([[0]]), cache=cache))
    payload, _ = layout.slice_tail(cache, 0, 1, state=layout.capture(cache, 1))
    rules = {}
    for name, array in layout.to_arrays(payload).items():
        kind = layout.specs[int(layer_of(name))].kind
        dtype = str(array.dtype).removeprefix("mlx.core.")
        per_token = kind != STATE and array.ndim > TOKEN_AXIS
        rules[name] = ArrayRule(dtype, tuple(array.shape), per_token=per_token, required=kind == KV)
    return TableExpectation(rules, layout.block_size)
