"""A decoding request's KV is read from the batch's own arrays, not copied whole (issue 26): its
prompt's blocks are cut from views of the batch (mlx-lm's `extract` copied the whole KV first, on
the big-KV model 0.55 GiB between the first token and the second), the views are dropped before the
batch writes again (held, every write would copy the batch's arrays whole), and a lone request that
leaves the batch for the speculative path takes the batch's arrays themselves, room kept (no copy
out, no copy to grow). Every path gives the tokens of a cold run."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvharness import greedy, make_generator
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache
from mlx_lm.utils import load
from test_speculative import generator, repetitive, run

from mlx_kvserve.engine.request import GenerationRequest, SamplingParams
from mlx_kvserve.kv import blocks

BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def address(a: mx.array) -> int:
    """Where the array's data starts (an evaluated array's own memory, as NumPy sees it)."""
    return np.asarray(a).__array_interface__["data"][0]


def shares(a: mx.array, b: mx.array) -> bool:
    return bool(np.shares_memory(np.asarray(a), np.asarray(b)))


def filled(length: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, length, 8)), mx.random.normal((1, 2, length, 8)))
    return c


def test_a_borrowed_row_is_extracts_data_in_the_batchs_own_memory():
    batch = BatchKVCache.merge([filled(5), filled(9)])  # the shorter row left-padded
    mx.eval(batch.keys, batch.values)
    for idx in (0, 1):
        row, copied = blocks.borrowed_row(batch, idx), batch.extract(idx)
        assert row.offset == copied.offset == (5, 9)[idx]
        assert mx.array_equal(row.keys, copied.keys) and mx.array_equal(row.values, copied.values)
        assert shares(row.keys, batch.keys) and shares(row.values, batch.values)
    lone = BatchKVCache.merge([filled(7)])
    taken = blocks.borrowed_row(lone, 0, whole=True)
    assert taken.keys is lone.keys and taken.values is lone.values and taken.offset == 7
    # Other kinds keep mlx-lm's extract.
    rotating = RotatingKVCache(max_size=4)
    rotating.update_and_fetch(mx.random.normal((1, 2, 6, 8)), mx.random.normal((1, 2, 6, 8)))
    windowed = BatchRotatingKVCache.merge([rotating])
    assert type(blocks.borrowed_row(windowed, 0)) is type(windowed.extract(0))


def test_registering_a_prompt_borrows_its_kv_and_the_batch_then_writes_in_place(tiny, monkeypatch):
    model, tokenizer = tiny
    gen = make_generator(model, tokenizer, BS)
    real = blocks.borrowed_row
    borrowed: list[bool] = []  # whether each row borrowed shares the batch's memory (the rows not kept here)

    def spy(c, idx, whole=False):
        row = real(c, idx, whole)
        borrowed.append(shares(row.keys, c.keys))
        return row

    monkeypatch.setattr("mlx_kvserve.engine.batch.mlx_batch.borrowed_row", spy)
    question = tokenizer.encode("Write a long story about a lighthouse, with many details. " * 5)
    events: list = []
    req = GenerationRequest("q", question, SamplingParams(max_tokens=12, temperature=0.0), events.append)
    scheduler = gen.scheduler
    scheduler.admit(req)
    addresses, registered_at = [], None
    while scheduler.is_running(req):
        scheduler.step()
        run_ = next(iter(scheduler._running.values()), None)
        decoding = scheduler._generator()._generation_batch
        if run_ is not None and run_.prompt_registered and len(decoding):
            if registered_at is None:
                registered_at = len(addresses)
                assert borrowed and all(borrowed)  # its blocks were cut from the batch's own arrays
            addresses.append(address(decoding.prompt_cache[0].keys))
    assert registered_at is not None and len(addresses) >= 4
    assert len(set(addresses)) == 1, "the batch's keys were copied on a write after the registration"
    assert events[-1].token_ids == greedy(make_generator(model, tokenizer, BS), question, 12)[0]


def test_a_lone_request_takes_the_batchs_arrays_onto_the_speculative_path(tiny, monkeypatch):
    model, tokenizer = tiny
    gen = generator(model, tokenizer, speculate=True, force=True)
    real = blocks.borrowed_row
    taken: list = []  # (the batch's keys, the row) of each whole row handed over

    def spy(c, idx, whole=False):
        row = real(c, idx, whole)
        if whole:
            taken.append((c.keys, row))
        return row

    monkeypatch.setattr("mlx_kvserve.engine.batch.mlx_batch.borrowed_row", spy)
    spec = gen.scheduler.speculation
    first_pass: list = []
    real_step = type(spec).step

    def step(self):
        if not first_pass:
            layer = self.solo.cache[0]
            first_pass.append((layer.keys, layer.keys.shape[2], layer.offset))
        out = real_step(self)
        if len(first_pass) == 1:
            first_pass.append(self.solo.cache[0].keys.shape[2] if self.solo is not None else None)
        return out

    monkeypatch.setattr(type(spec), "step", step)
    prompt = repetitive(tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with_spec = run(gen, prompt, params)
    assert spec.stats.solo_requests == 1 and len(first_pass) == 2, "the request decoded on the speculative path"
    (keys, length, offset), length_after = first_pass
    batch_keys, row = taken[0]
    assert keys is batch_keys and row.keys is batch_keys  # the batch's own array, not a copy
    assert length > offset and length_after == length  # its room kept: the verify pass wrote in place
    plain = run(generator(model, tokenizer, speculate=False), prompt, params)
    assert with_spec[:4] == plain[:4]
