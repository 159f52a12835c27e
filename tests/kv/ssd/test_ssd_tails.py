"""Tails on the SSD: verified files, best prefix match, per-parent limit, damage, TTL, clear."""

import os
import time

import mlx.core as mx
from kvharness import OPEN_TIERS

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.kv.ssd.format import read_header
from mlx_kvserve.kv.ssd.store import SaveResult, SSDStore, store_dir
from mlx_kvserve.kv.ssd.tails import SSDTailStore
from mlx_kvserve.kv.ssd.tier import SSDTier
from mlx_kvserve.kv.ssd.writer import SSDWriterThread
from mlx_kvserve.kv.tails import TailStore

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


def stored_tails(folder, parent=PARENT) -> list[tuple[int, ...]]:
    return sorted(read_header(p, NS).token_ids for p in (folder / parent.hex()).glob("*.safetensors"))


def test_per_parent_limit_replaces_the_least_recently_used(tmp_path):
    """A file's mtime is its tail's last use: written (at `used_at`, which a writer's delay does
    not move), produced again, or served from RAM (`touch`)."""
    store = SSDTailStore(tmp_path, NS, per_parent=2, exact=True)
    now = time.time()
    store.save(PARENT, [1], arrays(1), used_at=now - 30)
    store.save(PARENT, [1, 2], arrays(2), used_at=now - 20)
    assert store.touch(PARENT, [1])  # served from RAM: now the newest
    assert not store.touch(PARENT, [7])  # no such file
    store.save(PARENT, [1, 3], arrays(2, 1), used_at=now - 10)
    assert stored_tails(tmp_path) == [(1,), (1, 3)]
    store.save(PARENT, [1, 4], arrays(2, 2), used_at=now - 40)  # used before the others: it goes
    assert stored_tails(tmp_path) == [(1,), (1, 3)]
    assert store.save(PARENT, [1, 3], arrays(2, 1), used_at=now + 5) is SaveResult.DEDUP  # produced again
    store.save(PARENT, [1, 5], arrays(2, 3), used_at=now + 1)
    assert stored_tails(tmp_path) == [(1, 3), (1, 5)]


def _tiered_manager(folder) -> tuple[KVManager, TailStore, SSDTier]:
    """A manager whose checkpoint tails (exact, as for recurrent models) also go to an SSD tier in
    `folder`, through its writer thread; payloads are the arrays themselves."""
    store = SSDStore(store_dir(folder, NS), NS)
    store.validate_index()
    holder: list[SSDTier] = []
    writer = SSDWriterThread(lambda *job: holder[0].save_job(*job))
    from_arrays = lambda a: (a, sum(x.nbytes for x in a.values()))  # noqa: E731
    tier = SSDTier(store, writer, "write_through", dict, from_arrays, write_hold_s=30.0, exact_tails=True)
    holder.append(tier)
    OPEN_TIERS.append(tier)
    ram_tails = TailStore(1 << 20, exact=True)
    return KVManager(BlockHasher(NS, 4), RAMStore(1 << 20), ram_tails, tier), ram_tails, tier


def test_the_ssd_keeps_the_tails_ram_keeps_for_a_restart(tmp_path):
    """More checkpoints under one parent than the per-parent limit (4), as one chat request takes
    after a system prompt: RAM keeps the ones used last, the shared [1] among them, and so must the
    SSD — also when [1] is served from RAM while its write still waits for the writer."""
    mgr, ram_tails, tier = _tiered_manager(tmp_path)
    parent = mgr.hasher.namespace  # prompts shorter than a block: tails of the namespace
    tier.hold_writes()  # a request prefilling: the writes below wait in the queue
    for ids in ([1], [1, 2], [1, 3], [1, 4]):
        mgr.cache_tail(parent, ids, arrays(len(ids), ids[-1]), 100)
    assert mgr.lookup([1, 9, 9]).tail_tokens == 1  # served from RAM, still queued for the SSD
    tier.resume_writes()
    assert tier.writer.wait_idle(10) == 0
    for ids in ([1, 5], [1, 6], [1, 7]):
        mgr.cache_tail(parent, ids, arrays(2, ids[-1]), 100)
        assert tier.writer.wait_idle(10) == 0
        assert mgr.lookup([1, 9, 9]).tail_tokens == 1  # served from RAM, on the SSD already
    mgr.cache_tail(parent, [1, 8], arrays(2, 8), 100)
    assert tier.close(10)
    kept_in_ram = sorted(t.token_ids for t in ram_tails)
    assert kept_in_ram == [(1,), (1, 6), (1, 7), (1, 8)]
    assert stored_tails(tier.store.cache_dir / "tails", parent) == kept_in_ram

    restarted, _, tier = _tiered_manager(tmp_path)
    assert restarted.lookup([1, 9, 9]).tail_tokens == 1  # from the SSD
    assert tier.close(10)


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
