"""SSDStore.load_blocks: a chain's files read together in windows (issue 14 item 2). Damage in the
middle of a window makes only the damaged block and what follows it in this lookup miss; the
blocks after it stay on disk and hit once the damaged one is written again. Every test runs on both
read paths: through mlx (the CPU and Apple GPUs) and through host memory on a thread pool (CUDA)."""

import mlx.core as mx
import numpy as np
import pytest
from test_ssd_store import NS, make_store

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.ssd.format import block_relpath
from mlx_kvserve.kv.ssd.reads import LOAD_WINDOW

BS = 4
NUM_BLOCKS = 3 * LOAD_WINDOW // 2 + 1  # spans two windows and part of a third


def chain(num_blocks: int = NUM_BLOCKS) -> list[tuple[bytes, bytes, list[int], dict[str, mx.array]]]:
    """(hash, parent, tokens, arrays) of each block of one chain of distinct random payloads."""
    tokens = list(range(100, 100 + num_blocks * BS))
    hashes = BlockHasher(NS, BS).hash_blocks(tokens)
    out = []
    for i, h in enumerate(hashes):
        arrays = {
            f"{layer}.{kind}": mx.random.normal((1, 2, BS, 8), key=mx.random.key(i))
            for layer in range(2)
            for kind in "kv"
        }
        mx.eval(arrays)
        out.append((h, hashes[i - 1] if i else NS, tokens[i * BS : (i + 1) * BS], arrays))
    return out


@pytest.fixture(params=[False, True], ids=["mlx-reads", "host-reads"])
def saved(tmp_path, request):
    store = make_store(tmp_path)
    store.host_reads = request.param
    blocks = chain()
    for h, parent, tokens, arrays in blocks:
        store.save_block(h, parent, tokens, arrays)
    return store, blocks


def wanted(blocks) -> list[tuple[bytes, list[int]]]:
    return [(h, tokens) for h, _, tokens, _ in blocks]


def same_arrays(loaded, arrays) -> bool:
    return sorted(loaded.arrays) == sorted(arrays) and all(
        np.array_equal(np.asarray(loaded.arrays[k]), np.asarray(v)) for k, v in arrays.items()
    )


def test_a_whole_chain_loads_in_order_bit_for_bit(saved):
    store, blocks = saved
    loaded = store.load_blocks(wanted(blocks))
    assert len(loaded) == len(blocks)
    for got, (_, parent, tokens, arrays) in zip(loaded, blocks, strict=True):
        assert got.token_ids == tuple(tokens) and got.parent_hash == parent and same_arrays(got, arrays)
    assert store.stats()["ssd_hits"] == len(blocks)


def test_loading_stops_at_the_first_block_not_on_disk(saved):
    store, blocks = saved
    store._remove(blocks[5][0])  # as eviction does
    assert len(store.load_blocks(wanted(blocks))) == 5
    assert store.stats()["ssd_misses"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("victim", [3, LOAD_WINDOW, NUM_BLOCKS - 1])  # inside, first of, last of a window
def test_damage_in_the_middle_misses_only_the_damaged_block(saved, tmp_path, damage, victim):
    store, blocks = saved
    path = tmp_path / block_relpath(blocks[victim][0])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 40] ^= 0x55  # a value byte: only the checksum sees it
    else:
        data = data[: len(data) - 100]
    path.write_bytes(bytes(data))
    loaded = store.load_blocks(wanted(blocks))
    assert [b.token_ids for b in loaded] == [tuple(t) for _, _, t, _ in blocks[:victim]]
    assert all(same_arrays(got, b[3]) for got, b in zip(loaded, blocks, strict=False))
    assert not path.exists() and store.stats()["ssd_corrupt"] == 1
    after = [b[0] for b in blocks[victim + 1 :]]
    assert all(store.contains(h) for h in after)  # the blocks after it stay on disk
    h, parent, tokens, arrays = blocks[victim]
    store.save_block(h, parent, tokens, arrays)  # recomputed and written again
    assert len(store.load_blocks(wanted(blocks))) == len(blocks)


def test_other_tokens_under_a_hash_end_the_chain_and_keep_the_file(saved):
    store, blocks = saved
    asked = wanted(blocks)
    asked[4] = (asked[4][0], [9, 9, 9, 9])
    assert len(store.load_blocks(asked)) == 4
    assert store.contains(blocks[4][0])
