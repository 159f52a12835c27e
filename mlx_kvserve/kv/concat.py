"""Blocks joined into one array per layer at the memory's speed.

Assembling a cached prefix copies every block's keys and values into the arrays the prefill and the
decode read: on the CPU one thread copies at ~11 GB/s here, and both cores are idle meanwhile (the
model waits for the prefix). MLX runs each CPU stream's work on a thread of its own, so the values
are joined on a second stream of the calling thread while its default stream joins the keys: 0.55 GiB
in 0.055 s instead of 0.10 s on this project's two-core CPU machine (scripts/bench_warm_memory.py).
On a GPU one stream does both (its copies are one kernel each already)."""

from __future__ import annotations

import threading

import mlx.core as mx

_side = threading.local()  # MLX's streams belong to the thread that made them: one second stream per thread


def side_stream() -> mx.Stream | None:
    """This thread's second CPU stream (made on first use); None off the CPU."""
    if mx.default_device() != mx.cpu:
        return None
    stream = getattr(_side, "stream", None)
    if stream is None:
        stream = _side.stream = mx.new_stream(mx.cpu)
    return stream


def join_pair(keys: list[mx.array], values: list[mx.array]) -> tuple[mx.array, mx.array]:
    """(the keys joined along the positions axis, the values likewise), the two copies side by side
    on the CPU. Lazy, as mx.concatenate: the caller evaluates them."""
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2, stream=side_stream())
