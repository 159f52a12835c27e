"""kv/concat.py: a prefix's keys and values joined on two CPU streams give mx.concatenate's arrays."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from mlx_kvserve.kv import concat


def blocks(n: int, dtype=mx.float32) -> list[mx.array]:
    return [mx.random.normal((1, 2, 16, 8)).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_join_pair_gives_the_concatenation_of_each(dtype):
    keys, values = blocks(5, dtype), blocks(5, dtype)
    k, v = concat.join_pair(keys, values)
    mx.eval(k, v)
    assert mx.array_equal(k, mx.concatenate(keys, axis=2)).item()
    assert mx.array_equal(v, mx.concatenate(values, axis=2)).item()
    assert k.shape == (1, 2, 80, 8) and k.dtype == dtype


def test_the_values_run_on_a_second_stream_of_this_thread_and_feed_the_default_one():
    if mx.default_device() != mx.cpu:
        pytest.skip("one stream off the CPU")
    side = concat.side_stream()
    assert side is concat.side_stream() and side != mx.default_stream(mx.cpu)
    # Lazy inputs computed on the default stream, joined on the side stream, used on the default again.
    values = [b * 2 for b in blocks(3)]
    _, v = concat.join_pair(blocks(3), values)
    assert mx.allclose((v + 1)[..., :16, :], values[0] + 1).item()


def test_each_thread_has_its_own_side_stream():
    seen: list = []

    def work():
        k, v = concat.join_pair(blocks(2), blocks(2))
        mx.eval(k, v)
        seen.append((concat.side_stream(), v.shape))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [shape for _, shape in seen] == [(1, 2, 32, 8)] * 2
    if mx.default_device() == mx.cpu:
        assert seen[0][0] != seen[1][0]
