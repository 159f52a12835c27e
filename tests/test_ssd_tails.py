"""Tails on the SSD: verified files, best prefix match, per-parent limit, damage, TTL, clear."""

import os
import time

import mlx.core as mx

from mlx_kvserve.kv.ssd import SaveResult
from mlx_kvserve.kv.ssd_tails import SSDTailStore

NS = b"\x05" * 32
PARENT = b"\x09" * 32


def arrays(n: int, seed: int = 0):
    mx.random.seed(seed)
    out = {"0.k": mx.random.normal((1, 2, n, 4)), "0.v": mx.random.normal((1, 2, n, 4))}
    mx.eval(list(out.values()))
    return out


def test_best_tail_is_the_longest_shared_prefix_and_round_trips(tmp_path):
    store = SSDTailStore(tmp_path, NS)
    a = arrays(3, 1)
    assert store.save(PARENT, [1, 2, 3], a)
    assert store.save(PARENT, [1, 2, 9, 9], arrays(4, 2))
    assert store.save(PARENT, [1, 2, 3], a) is SaveResult.DEDUP  # already stored
    got = store.best(PARENT, [1, 2, 3, 7])
    assert got.token_ids == (1, 2, 3) and got.num_shared == 3
    assert all(mx.array_equal(got.arrays[k], a[k]).item() for k in a)
    assert store.best(PARENT, [5]) is None
    assert store.best(b"\x01" * 32, [1, 2]) is None
    assert store.stats["ssd_tail_saves"] == 2 and store.stats["ssd_tail_hits"] == 1


def test_per_parent_limit_keeps_the_newest(tmp_path):
    store = SSDTailStore(tmp_path, NS, per_parent=2)
    for i in range(4):
        store.save(PARENT, [i, i], arrays(2, i))
        time.sleep(0.01)
    assert len(list((tmp_path / PARENT.hex()).glob("*.safetensors"))) == 2
    assert store.best(PARENT, [0, 0]) is None and store.best(PARENT, [3, 3]).num_shared == 2


def test_damaged_tail_is_a_miss_and_deleted(tmp_path):
    store = SSDTailStore(tmp_path, NS)
    store.save(PARENT, [4, 5, 6], arrays(3))
    (path,) = (tmp_path / PARENT.hex()).glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.best(PARENT, [4, 5, 6]) is None
    assert not path.exists() and store.stats["ssd_tail_errors"] == 1
    other_ns = SSDTailStore(tmp_path, b"\x06" * 32)
    store.save(PARENT, [4, 5, 6], arrays(3))
    assert other_ns.best(PARENT, [4, 5, 6]) is None  # another namespace never matches


def test_prune_and_clear(tmp_path):
    store = SSDTailStore(tmp_path, NS)
    store.save(PARENT, [1], arrays(1))
    store.save(b"\x02" * 32, [2], arrays(1))
    (old,) = (tmp_path / PARENT.hex()).glob("*.safetensors")
    os.utime(old, (time.time() - 1000, time.time() - 1000))
    assert store.prune(ttl_s=500) == 1
    assert store.clear() == 1 and not tmp_path.exists()
