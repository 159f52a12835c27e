"""One SSD budget across several namespace folders (kv/ssd/budget.py with registry/ssd_share.py's LRU
plan), without a model: small random blocks in three stores, tmp_path, a fake clock. The total stays
within the budget, the least recently used folder gives room first, pinned blocks (pins and leases,
also of a folder at rest) survive, and a folder another process holds is left alone."""

import mlx.core as mx
import pytest

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.leases import LEASES_FILE, PinLeases
from mlx_kvserve.kv.pins import PINS_FILE, PinRegistry
from mlx_kvserve.kv.ssd import FolderLock, SSDStore, store_dir
from mlx_kvserve.kv.ssd.budget import FolderUse, SSDBudget, Trim
from mlx_kvserve.registry.ssd_share import lru_trims

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 1.0  # every reading is later than the last: a strict LRU order
        return self.t


def namespace(name: str) -> bytes:
    return namespace_hash(name, "float32", BS)


def block(ns: bytes, seed: int):
    tokens = [seed * 10 + i for i in range(BS)]
    arrays = {f"0.{kind}": mx.random.normal((1, 2, BS, 8), key=mx.random.key(seed)) for kind in "kv"}
    mx.eval(list(arrays.values()))
    return BlockHasher(ns, BS).hash_blocks(tokens)[0], ns, tokens, arrays


def open_store(root, name: str, pins: set[bytes] | None = None) -> SSDStore:
    ns = namespace(name)
    pinned = pins if pins is not None else set()
    return SSDStore(store_dir(root, ns), ns, is_pinned=lambda h: h in pinned)


def fill(store: SSDStore, seeds: range) -> list[bytes]:
    saved = []
    for seed in seeds:
        args = block(store.namespace, seed)
        store.save_block(*args)
        saved.append(args[0])
    return saved


def disk_bytes(root) -> int:
    """Bytes of every block and tail file under the cache root (bookkeeping files aside)."""
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


@pytest.fixture
def one_block(tmp_path) -> int:
    store = SSDStore(tmp_path.parent / f"{tmp_path.name}-probe", namespace("probe"))
    fill(store, range(1))
    return store.used_bytes()


def test_three_stores_stay_within_one_budget_and_the_least_recently_used_gives_room(tmp_path, one_block):
    budget = SSDBudget(10 * one_block, lru_trims, FakeClock())
    a, b, c = (open_store(tmp_path, n) for n in "abc")
    for store in (a, b, c):
        budget.attach(store)
    first_a = fill(a, range(0, 4))
    first_b = fill(b, range(10, 14))
    assert disk_bytes(tmp_path) <= 10 * one_block
    fill(c, range(20, 24))  # 12 blocks asked for, 10 fit: a (the least recently used) gives 2
    assert disk_bytes(tmp_path) <= 10 * one_block
    assert [a.contains(h) for h in first_a] == [False, False, True, True]  # a's own oldest went first
    assert all(b.contains(h) for h in first_b) and c.used_bytes() == 4 * one_block
    budget.touch(a.cache_dir)  # a is used again: b is now the least recently used
    fill(c, range(24, 26))
    assert sum(b.contains(h) for h in first_b) == 2 and a.used_bytes() == 2 * one_block
    budget.check_integrity()
    for store in (a, b, c):
        store.check_integrity()


def test_pinned_blocks_are_a_floor_no_trim_goes_below(tmp_path, one_block):
    pins: set[bytes] = set()
    budget = SSDBudget(6 * one_block, lru_trims, FakeClock())
    a, b = open_store(tmp_path, "a", pins), open_store(tmp_path, "b")
    budget.attach(a)
    budget.attach(b)
    pins.update(fill(a, range(0, 3)))  # a's three blocks are pinned
    fill(b, range(10, 20))  # b wants ten: a keeps its pins, b holds what is left
    assert a.used_bytes() == 3 * one_block and b.used_bytes() == 3 * one_block
    assert disk_bytes(tmp_path) <= 6 * one_block
    budget.check_integrity()


def test_a_folder_at_rest_is_trimmed_under_its_lock_keeping_its_pins(tmp_path, one_block):
    budget = SSDBudget(8 * one_block, lru_trims, FakeClock())
    a, b = open_store(tmp_path, "a"), open_store(tmp_path, "b")
    budget.attach(a)
    budget.attach(b)
    saved = fill(a, range(0, 5))
    PinRegistry(a.cache_dir / PINS_FILE).pin(saved[:1])  # pins.json, as the engine writes it
    PinLeases(a.cache_dir / LEASES_FILE).grant(saved[:2], ttl_s=600)  # a cache_control lease holds the second
    a.flush()
    budget.hold(a.cache_dir)  # unloading: its drain may still write
    budget.detach(a.cache_dir)  # its model is unloaded: its folder is at rest
    assert budget.used_of(a.cache_dir) == 5 * one_block
    fill(b, range(10, 18))  # needs 8: the folder at rest gives its 3 unpinned blocks
    assert budget.used_of(a.cache_dir) == 2 * one_block and b.used_bytes() == 6 * one_block
    assert disk_bytes(tmp_path) <= 8 * one_block
    again = open_store(tmp_path, "a")  # its index was written by the trim: it matches the files
    again.check_integrity()
    assert [again.contains(h) for h in saved] == [True, True, False, False, False]
    lock = FolderLock.acquire_server(a.cache_dir)  # the budget let the folder go
    assert lock.is_owner
    lock.release()


def test_a_folder_another_process_holds_is_not_counted_nor_trimmed(tmp_path, one_block):
    budget = SSDBudget(6 * one_block, lru_trims, FakeClock())
    other = open_store(tmp_path, "other")
    fill(other, range(0, 3))
    other.flush()
    held = FolderLock.acquire_server(other.cache_dir)  # another server owns it
    try:
        assert not budget.add_folder(other.cache_dir, other.namespace, last_used=0.0)
        mine = open_store(tmp_path, "mine")
        budget.attach(mine)
        fill(mine, range(10, 16))
        assert other.used_bytes() == 3 * one_block and mine.used_bytes() == 6 * one_block
    finally:
        held.release()
    assert budget.add_folder(other.cache_dir, other.namespace, last_used=0.0)  # free now: counted
    fill(mine, range(16, 17))  # the folder at rest (older) gives all it has before mine evicts its own
    assert budget.used_of(other.cache_dir) == 0 and mine.used_bytes() == 6 * one_block
    assert disk_bytes(tmp_path) <= 6 * one_block


def test_the_plan_takes_idle_headroom_first_then_files_least_recently_used_first_down_to_pins(tmp_path):
    def use(name, used, cap, pinned, last, held=False):
        return FolderUse(tmp_path / name, b"", used, pinned, cap, last, held=held)

    uses = [use("asking", 0, 0, 0, 9), use("new", 50, 80, 0, 8), use("old", 100, 100, 40, 1), use("mid", 30, 30, 0, 5)]
    assert lru_trims(uses, tmp_path / "asking", 20) == [Trim(tmp_path / "new", 60)]  # headroom: nothing lost
    assert lru_trims(uses, tmp_path / "asking", 90) == [Trim(tmp_path / "new", 50), Trim(tmp_path / "old", 40)]
    everything = [Trim(tmp_path / "new", 40), Trim(tmp_path / "old", 40), Trim(tmp_path / "mid", 0)]
    assert lru_trims(uses, tmp_path / "asking", 130) == everything  # "new", the most recent, last
    assert lru_trims(uses, tmp_path / "asking", 10**6) == [Trim(tmp_path / "new", 0), *everything[1:]]
    uses[2] = use("old", 100, 100, 40, 1, held=True)  # unloading or loading: left alone
    assert all(t.folder != tmp_path / "old" for t in lru_trims(uses, tmp_path / "asking", 100))


def test_a_share_lent_to_another_process_is_counted_whole_and_freed_when_given_back(tmp_path, one_block):
    """A model in a process of its own budgets its folder alone within the bytes lent it: the lend
    trims the least recently used folder for it, the loaded stores stay within what is left, and
    giving it back lets them grow again, its folder then counted at rest at its own bytes."""
    budget = SSDBudget(10 * one_block, lru_trims, FakeClock())
    a, b = open_store(tmp_path, "a"), open_store(tmp_path, "b")
    budget.attach(a)
    budget.attach(b)
    fill(a, range(0, 4))
    fill(b, range(10, 14))
    before_b = b.used_bytes()
    assert budget.lend(tmp_path / "<process of c>", 5 * one_block) == 5 * one_block
    assert a.used_bytes() == 5 * one_block - before_b and b.used_bytes() == before_b  # a, the oldest, gave
    fill(b, range(14, 18))  # b may not grow into the lent share: a, then b's own oldest, give
    assert b.used_bytes() + a.used_bytes() <= 5 * one_block and b.used_bytes() >= before_b
    assert budget.describe()["ssd_used_bytes"] == a.used_bytes() + b.used_bytes() + 5 * one_block
    budget.check_integrity()
    c = open_store(tmp_path, "c")  # what that process wrote, within its cap
    fill(c, range(20, 22))
    c.flush()
    budget.give_back(tmp_path / "<process of c>")
    assert budget.add_folder(c.cache_dir, c.namespace, last_used=0.0)
    assert budget.used_of(c.cache_dir) == 2 * one_block
    b_before = b.used_bytes()
    fill(b, range(18, 21))  # room again: b keeps all it had and adds three
    assert b.used_bytes() == b_before + 3 * one_block and disk_bytes(tmp_path) <= 10 * one_block
    budget.check_integrity()


def test_a_lend_gets_what_pins_leave(tmp_path, one_block):
    pins: set[bytes] = set()
    budget = SSDBudget(6 * one_block, lru_trims, FakeClock())
    a = open_store(tmp_path, "a", pins)
    budget.attach(a)
    pins.update(fill(a, range(0, 4)))
    assert budget.lend(tmp_path / "<process of b>", 6 * one_block) == 2 * one_block
    assert a.used_bytes() == 4 * one_block
    budget.check_integrity()
