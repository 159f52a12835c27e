"""Runs (kv/runs.py): blocks registered together are views of one copy per layer, and a hit joins one
piece per run per layer, whatever the block size, with the same arrays as joining block by block."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.engine.cache.prefix_cache import _stretches
from mlx_kvserve.kv import blocks, cache_fill, runs
from mlx_kvserve.kv.base import Block
from mlx_kvserve.kv.payloads import KV, LayerSpec
from mlx_kvserve.kv.ram import RAMStore

LAYERS, HEADS, DIM = 3, 2, 32


class _ShapeOnly:
    """What CacheLayout needs of a model: its caches."""

    layers = [object()] * LAYERS

    def make_cache(self):
        return [KVCache() for _ in range(LAYERS)]


def _layout(block_size: int, kv_bits: int = 0) -> blocks.CacheLayout:
    return blocks.CacheLayout(_ShapeOnly(), [LayerSpec(KV)] * LAYERS, "", "float32", block_size, kv_bits)


def _filled(layout: blocks.CacheLayout, length: int, seed: int = 0) -> list:
    mx.random.seed(seed)
    cache = layout.new_cache()
    for c in cache:
        c.update_and_fetch(mx.random.normal((1, HEADS, length, DIM)), mx.random.normal((1, HEADS, length, DIM)))
    mx.eval([c.keys for c in cache])
    return cache


def _owned(payload: list) -> list:
    """The payload as blocks loaded from the SSD are: entries owning their own arrays, no run."""
    owned = [tuple(mx.array(a) for a in entry) for entry in payload]
    mx.eval(owned)  # copied now: a lazy copy would hold what it copies
    return owned


def _joined(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the arrays each join (one per layer) takes."""
    counts: list[int] = []
    real = blocks.join_pair

    def spy(keys, values):
        counts.append(len(keys))
        return real(keys, values)

    monkeypatch.setattr(blocks, "join_pair", spy)  # window layers
    monkeypatch.setattr(cache_fill, "join_pair", spy)  # full-attention layers
    return counts


@pytest.mark.parametrize("kv_bits", [0, 8])
def test_a_hit_joins_one_piece_per_run_with_the_arrays_a_join_per_block_gives(monkeypatch, kv_bits):
    bs = 4
    layout = _layout(bs, kv_bits)
    cache = _filled(layout, 40)
    # Two registrations (a first turn's 6 blocks, the next turn's 4), and a tail of 3 positions after them.
    first = [p for p, _ in layout.slice_blocks(cache, 0, 6, bs)]
    second = [p for p, _ in layout.slice_blocks(cache, 6, 10, bs)]
    tail, _ = layout.slice_tail(_filled(layout, 43, seed=1), 40, 43)
    payloads = first + second
    assert all(isinstance(p, runs.RunPayload) for p in payloads)
    assert len(runs.spans(payloads, bs)) == 2

    counts = _joined(monkeypatch)
    by_run = layout.assemble(payloads, tail, 3, 3, room=5)
    assert counts == [2 + 1 + 1] * LAYERS  # two runs, the tail, the room
    counts.clear()
    by_block = layout.assemble([_owned(p) for p in payloads], tail, 3, 3, room=5)
    assert counts == [10 + 1 + 1] * LAYERS
    for a, b in zip(by_run, by_block, strict=True):
        assert a.offset == b.offset == 43
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
    if not kv_bits:  # and what the cache held, position for position
        for a, c in zip(by_run, cache, strict=True):
            assert mx.array_equal(a.keys[..., :40, :], c.keys[..., :40, :])


def test_the_join_count_does_not_grow_with_the_number_of_blocks(monkeypatch):
    counts = _joined(monkeypatch)
    for bs in (2, 8, 32):
        layout = _layout(bs)
        cache = _filled(layout, 256)
        payloads = [p for p, _ in layout.slice_blocks(cache, 0, 256 // bs, bs)]
        counts.clear()
        layout.assemble(payloads[: 200 // bs], room=1)  # a prefix: part of the run, one slice of it
        assert counts == [2] * LAYERS, bs  # the run's slice and the room


def test_blocks_out_of_order_or_from_elsewhere_are_joined_as_they_come(monkeypatch):
    bs = 4
    layout = _layout(bs)
    cache = _filled(layout, 32)
    payloads = [p for p, _ in layout.slice_blocks(cache, 0, 8, bs)]
    mixed = [payloads[0], payloads[1], _owned(payloads[2]), payloads[3], payloads[5]]
    assert [(s.run is None, s.lo, s.hi) for s in runs.spans(mixed, bs)] == [
        (False, 0, 8),
        (True, 0, 4),
        (False, 12, 16),
        (False, 20, 24),
    ]
    counts = _joined(monkeypatch)
    got = layout.assemble(mixed)
    assert counts == [4] * LAYERS
    want = layout.assemble([_owned(p) for p in mixed])
    for a, b in zip(got, want, strict=True):
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)


def test_blocks_are_views_of_one_copy_per_layer():
    bs, n = 16, 64
    layout = _layout(bs)
    cache = _filled(layout, n * bs)
    before = mx.get_active_memory()
    cut = layout.slice_blocks(cache, 0, n, bs)
    copy_bytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert mx.get_active_memory() - before <= copy_bytes * 1.05  # one copy, not one per block on top
    assert sum(nbytes for _, nbytes in cut) == copy_bytes  # each block counts its own positions
    payload = cut[5][0]
    assert mx.array_equal(payload[1][0], cache[1].keys[..., 5 * bs : 6 * bs, :])


def test_registration_cuts_one_run_per_stretch_of_new_blocks():
    assert _stretches([]) == []
    assert _stretches([3, 4, 5, 8, 9, 11]) == [(3, 6), (8, 10), (11, 12)]


def test_a_run_mostly_gone_from_ram_is_compacted_and_its_memory_freed():
    bs, n = 16, 8
    layout = _layout(bs)
    cache = _filled(layout, n * bs)
    cut = layout.slice_blocks(cache, 0, n, bs)
    want = [_owned(p) for p, _ in cut]
    ram = RAMStore(1 << 30)
    stored = [Block(bytes([i]), b"", (), p, nbytes) for i, (p, nbytes) in enumerate(cut)]
    for i, block in enumerate(stored):
        ram.insert(block, i)
    old_run = stored[0].payload.run
    del cut, cache
    for block in stored[:3]:  # 5 of 8 left: more than half, nothing to do
        ram.remove(block.block_hash)
    runs.compact_pending(bs)
    assert all(b.payload.run is old_run for b in stored)
    ram.remove(stored[3].block_hash)  # blocks 4..7 left: half
    ram.remove(stored[6].block_hash)  # 4, 5 and 7 left, in two stretches
    runs.compact_pending(bs)
    kept = [stored[i].payload for i in (4, 5, 7)]
    assert kept[0].run is kept[1].run is not old_run and kept[2].run not in (old_run, kept[0].run)
    assert [(p.run.num_blocks, p.start) for p in kept] == [(2, 0), (2, bs), (1, 0)]
    for i, payload in zip((4, 5, 7), kept, strict=True):
        for got, expected in zip(payload, want[i], strict=True):
            assert all(mx.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    # The old run goes once the evicted blocks do: what is left holds 3 blocks' bytes, not 8.
    before = mx.get_active_memory()
    del stored[:4], stored[2], old_run, block  # blocks 0-3 and 6 (`block`: the loop's last, block 2)
    gc.collect()
    run_bytes = sum(e[0].nbytes + e[1].nbytes for e in kept[0].run.layers) // 2  # one block's
    assert before - mx.get_active_memory() >= 8 * run_bytes * 0.95
