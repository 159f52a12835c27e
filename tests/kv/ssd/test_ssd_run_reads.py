"""A restore reads a chain's block files into one buffer per full-attention array (kv/ssd/run_reads.py):
the same verified arrays as reading file by file, kept in RAM as one run, so the restore and the hits
after it join a few pieces per layer, and its greedy output is the cold run's. Damaged, forged,
foreign-table and other-token files are treated exactly as the per-block read treats them."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvharness import close_ssd, greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.kv import blocks, cache_fill, runs
from mlx_kvserve.kv.base import RequestBuffers
from mlx_kvserve.kv.ssd.store import BlockToSave, SSDStore
from mlx_kvserve.kv.ssd.table_check import ArrayRule, TableExpectation

NS = b"n" * 32
BS, HEADS, DIM, LAYERS = 8, 2, 16, 3


def _rules(window: bool = False) -> TableExpectation:
    """A layout of LAYERS full-attention layers (float32 keys and values), and with `window` a
    window layer whose arrays (int8, 3 wide: 3 * positions bytes, so its payload has padding) are
    not part of a run."""
    rules = {f"{i}.{s}": ArrayRule("float32", (1, HEADS, 1, DIM), True, True) for i in range(LAYERS) for s in "kv"}
    if window:
        rules.update({f"{LAYERS}.{s}": ArrayRule("int8", (1, 1, 1, 3), True, False) for s in "kv"})
    return TableExpectation(rules, BS)


def _blocks(n: int, window: bool = False) -> list[BlockToSave]:
    mx.random.seed(1)
    out, parent = [], NS
    for b in range(n):
        arrays = {f"{i}.{s}": mx.random.normal((1, HEADS, BS, DIM)) for i in range(LAYERS) for s in "kv"}
        if window:
            arrays.update({f"{LAYERS}.{s}": mx.full((1, 1, 5, 3), b + 1, mx.int8) for s in "kv"})
        mx.eval(list(arrays.values()))
        block_hash = bytes([b + 1]) * 32
        out.append(BlockToSave(block_hash, parent, tuple(range(b * BS, (b + 1) * BS)), arrays))
        parent = block_hash
    return out


def _store(tmp_path, window: bool = False) -> SSDStore:
    store = SSDStore(tmp_path, NS, table_rules=_rules(window))
    store.validate_index()
    return store


def _wanted(saved: list[BlockToSave]) -> list[tuple[bytes, tuple[int, ...]]]:
    return [(b.block_hash, tuple(b.token_ids)) for b in saved]


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("window", [False, True])
def test_a_chain_is_read_into_one_run_with_the_arrays_it_was_saved_with(tmp_path, host, window):
    store = _store(tmp_path, window)
    saved = _blocks(5, window)
    store.save_blocks(saved)
    store.host_reads = host
    loaded = store.load_blocks(_wanted(saved))
    assert len(loaded) == 5
    run = loaded[0].run
    assert run is not None and all(b.run is run and b.position == i for i, b in enumerate(loaded))
    assert run.num_blocks == 5 and run.arrays["0.k"].shape == (1, HEADS, 5 * BS, DIM)
    assert sorted(run.arrays) == [f"{i}.{s}" for i in range(LAYERS) for s in "kv"]  # no window array in it
    for block, got in zip(saved, loaded, strict=True):
        assert got.token_ids == tuple(block.token_ids) and got.parent_hash == block.parent_hash
        assert sorted(got.arrays) == sorted(block.arrays)
        for name, array in block.arrays.items():
            assert mx.array_equal(got.arrays[name], array).item(), name
    store.run_reads = False  # the per-block read gives the same arrays, no run
    per_block = store.load_blocks(_wanted(saved))
    assert [b.run for b in per_block] == [None] * 5
    for got, ref in zip(loaded, per_block, strict=True):
        assert all(mx.array_equal(got.arrays[n], ref.arrays[n]).item() for n in ref.arrays)
    assert store.stats()["ssd_hits"] == 10


@pytest.mark.parametrize("host", [False, True])
def test_a_chain_read_into_a_request_s_buffers_lands_after_its_lead(tmp_path, host):
    """A direct read (kv/base.py RequestBuffers): one run of the request's size however long (no
    RUN_BYTES split), its blocks after `lead_blocks` blocks, the lead zero, and no view
    handed out (the request writes the buffers in place); a damaged block ends the chain there."""
    store = _store(tmp_path)
    saved = _blocks(5)
    store.save_blocks(saved)
    store.host_reads = host
    _damage(store, saved[3].block_hash, "flip")
    loaded = store.load_blocks(_wanted(saved), into=RequestBuffers(2, 12 * BS))
    assert len(loaded) == 3 and all(b.arrays == {} and b.position == i for i, b in enumerate(loaded))
    run = loaded[0].run
    assert run.into == RequestBuffers(2, 12 * BS) and run.num_blocks == 3
    for name in saved[0].arrays:
        whole = run.arrays[name]
        assert whole.shape == (1, HEADS, 12 * BS, DIM)
        for i in range(3):
            part = whole[:, :, (2 + i) * BS : (3 + i) * BS]
            assert mx.array_equal(part, saved[i].arrays[name]).item(), name
        # The lead is zero until the request writes RAM's blocks there; past the chain's end (where a
        # block read beside the damaged one may have landed) the request writes before it reads.
        assert not mx.any(whole[:, :, : 2 * BS]).item() and not mx.any(whole[:, :, 8 * BS :]).item()
    assert store.stats()["ssd_corrupt"] == 1


def test_a_long_chain_is_read_as_runs_of_a_bounded_size(tmp_path, monkeypatch):
    from mlx_kvserve.kv.ssd import run_loads

    monkeypatch.setattr(run_loads, "RUN_BYTES", 2 * HEADS * BS * DIM * 4)  # two blocks an array
    store = _store(tmp_path)
    saved = _blocks(5)
    store.save_blocks(saved)
    loaded = store.load_blocks(_wanted(saved))
    assert [(b.run.num_blocks, b.position) for b in loaded] == [(2, 0), (2, 1), (2, 0), (2, 1), (1, 0)]
    assert loaded[0].run is loaded[1].run and loaded[1].run is not loaded[2].run
    for block, got in zip(saved, loaded, strict=True):
        assert all(mx.array_equal(got.arrays[n], a).item() for n, a in block.arrays.items())


def _damage(store: SSDStore, block_hash: bytes, how: str) -> None:
    path = store._path(block_hash)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) - 40] ^= 0xFF  # inside the last array's bytes
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[:-100]))


@pytest.mark.parametrize("how", ["flip", "truncate", "forged", "table"])
def test_a_damaged_file_stops_the_run_is_deleted_and_counted(tmp_path, how):
    store = _store(tmp_path)
    saved = _blocks(6)
    if how == "forged":  # a valid file made with another key
        other = SSDStore(tmp_path / "elsewhere", NS, table_rules=_rules())
        other.save_blocks(saved[3:4])
        store.save_blocks(saved[:3] + saved[4:])
        target = store._path(saved[3].block_hash)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(other._path(saved[3].block_hash).read_bytes())
        store.validate_index()
    elif how == "table":  # a well-made file whose arrays the layout does not have
        wrong = dict(saved[3].arrays, **{"0.k": mx.zeros((1, HEADS, BS, DIM + 1))})
        store.save_blocks(saved[:3] + [saved[3]._replace(arrays=wrong)] + saved[4:])
    else:
        store.save_blocks(saved)
        _damage(store, saved[3].block_hash, how)
    if how == "truncate":
        store.validate_index()  # a truncated file is caught by its header at startup
        assert not store._path(saved[3].block_hash).exists()
    loaded = store.load_blocks(_wanted(saved))
    assert len(loaded) == 3 and loaded[0].run.num_blocks == 3  # a run of the verified blocks only
    for block, got in zip(saved, loaded, strict=False):
        assert all(mx.array_equal(got.arrays[n], a).item() for n, a in block.arrays.items())
    assert not store._path(saved[3].block_hash).exists()
    if how != "truncate":
        assert store.stats()["ssd_corrupt"] == 1
    assert store._path(saved[4].block_hash).exists()  # the rest is read again next time, not judged


def test_a_file_with_other_tokens_is_a_collision_not_served(tmp_path):
    store = _store(tmp_path)
    saved = _blocks(4)
    store.save_blocks(saved)
    wanted = _wanted(saved)
    wanted[2] = (wanted[2][0], tuple(t + 1 for t in wanted[2][1]))
    loaded = store.load_blocks(wanted)
    assert len(loaded) == 2
    stats = store.stats()
    assert stats["ssd_collisions"] == 1 and stats["ssd_corrupt"] == 0
    assert store._path(saved[2].block_hash).exists()  # verified, kept: only isolated


def test_a_missing_block_ends_the_run(tmp_path):
    store = _store(tmp_path)
    saved = _blocks(4)
    store.save_blocks(saved[:2] + saved[3:])
    loaded = store.load_blocks(_wanted(saved))
    assert len(loaded) == 2 and loaded[1].run.num_blocks == 2


# --- through the engine: a restore after a restart -----------------------------------------------

TBS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def _joined(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The arrays each full-attention layer's join takes (kv/blocks.py's assembly)."""
    counts: list[int] = []
    real = blocks.join_pair

    def spy(keys, values):
        counts.append(len(keys))
        return real(keys, values)

    monkeypatch.setattr(blocks, "join_pair", spy)  # window layers
    monkeypatch.setattr(cache_fill, "join_pair", spy)  # full-attention layers
    return counts


def test_a_restore_reads_into_the_request_cache_and_answers_as_cold(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    text = " ".join(f"Entry {i}: the harbour light number {i} shines at {i * 3} o'clock." for i in range(40))
    prompt = tokenizer.encode(text)[: 12 * TBS + TBS // 2]
    cold_ids, cold_text, _ = greedy(make_generator(model, tokenizer, TBS), prompt, 12)
    first = make_generator(model, tokenizer, TBS, ssd_dir=tmp_path)
    greedy(first, prompt, 12)
    assert close_ssd(first)

    restarted = make_generator(model, tokenizer, TBS, ssd_dir=tmp_path)  # RAM empty: every block read
    joins = _joined(monkeypatch)
    ids, out_text, cached = greedy(restarted, prompt, 12)
    assert cached == len(prompt) - 1 and cached // TBS == 12
    assert ids == cold_ids and out_text == cold_text
    layers = len(model.layers)
    # The 12 blocks were read into the request's own cache (a direct run), the tail written into
    # it: no join at all (a join per layer of the run, the tail and the room before; 14 pieces
    # when read block by block).
    assert joins == []
    manager = restarted.prefix_cache.manager
    chain = manager.hasher.hash_blocks(prompt, 12)
    held = [manager._ram.get(h) for h in chain]  # RAM has the 12 since the request ended, as one run
    assert all(b is not None and isinstance(b.payload, runs.RunPayload) for b in held)
    assert len({id(b.payload.run) for b in held}) == 1 and not held[0].payload.run.direct
    assert [b.payload.start for b in held] == [i * TBS for i in range(12)]
    # Read, then registered without a copy; the one block the answer completed is new.
    assert manager.stats()["kv_promotions"] == 12 and manager.stats()["kv_inserts"] == 1
    joins.clear()
    ids, _, cached = greedy(restarted, prompt, 12)  # the next hit, from RAM: the same few pieces
    assert ids == cold_ids and cached == len(prompt) - 1
    assert joins[:layers] == [3] * layers
    restarted.prefix_cache.manager.check_integrity()
    restarted.prefix_cache.ssd_tier.store.check_integrity()
    close_ssd(restarted)


def test_a_restore_after_ram_blocks_writes_them_into_its_buffers_and_compacts(tiny, tmp_path, monkeypatch):
    """RAM holds the chain's first blocks, the SSD the rest: the rest is read into the request's
    buffers after room for the first, which the assembly copies there; the answer is the cold
    run's, and the direct run, half of it the blocks RAM held before, is compacted once its blocks
    joined RAM (so RAM's budget, which counts blocks, stays near the memory held)."""
    model, tokenizer = tiny
    text = " ".join(f"Entry {i}: the harbour light number {i} shines at {i * 3} o'clock." for i in range(40))
    prompt = tokenizer.encode(text)[: 12 * TBS + TBS // 2]
    short = prompt[: 4 * TBS + 1]
    cold_ids, cold_text, _ = greedy(make_generator(model, tokenizer, TBS), prompt, 12)
    first = make_generator(model, tokenizer, TBS, ssd_dir=tmp_path)
    greedy(first, prompt, 12)
    assert close_ssd(first)

    restarted = make_generator(model, tokenizer, TBS, ssd_dir=tmp_path)
    manager = restarted.prefix_cache.manager
    leads = []
    real = blocks.fill_direct
    monkeypatch.setattr(blocks, "fill_direct", lambda *a: leads.append(a[3]) or real(*a))
    assert greedy(restarted, short, 1)[2] == 4 * TBS  # its 4 blocks read, then in RAM
    ids, out_text, cached = greedy(restarted, prompt, 12)  # 4 from RAM, 8 read into its buffers
    assert (ids, out_text, cached) == (cold_ids, cold_text, len(prompt) - 1)
    assert leads == [0] * len(model.layers) + [4 * TBS] * len(model.layers)
    assert manager.stats()["kv_promotions"] == 12
    chain = manager.hasher.hash_blocks(prompt, 12)
    # The 8 filled half of the buffers (16 blocks' positions): copied out when the request registered its
    # new block (each run compacted at the next registration or assembly).
    second = [manager._ram.get(h).payload for h in chain[4:]]
    assert len({id(p.run) for p in second}) == 1 and second[0].run.num_blocks == 8
    assert [p.start for p in second] == [i * TBS for i in range(8)]
    ids, _, cached = greedy(restarted, prompt, 12)  # from RAM
    assert ids == cold_ids and cached == len(prompt) - 1
    manager.check_integrity()
    close_ssd(restarted)
