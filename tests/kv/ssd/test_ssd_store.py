"""SSDStore without a model: small random arrays, tmp_path, a fake clock."""

import errno
import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserve import fsmode
from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.ssd import format as ssd_format
from mlx_kvserve.kv.ssd.folder_key import KEY_FILE
from mlx_kvserve.kv.ssd.format import block_relpath
from mlx_kvserve.kv.ssd.index import INDEX_NAME
from mlx_kvserve.kv.ssd.store import SaveResult, SSDStore

BS = 4
NS = namespace_hash("m", "float32", BS)
DAY = 86400.0


class FakeClock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def block(seed: int, dtype=mx.float32, tokens=None):
    """(hash, parent, tokens, arrays) of a first block holding `tokens` (default: from the seed)."""
    tokens = list(tokens or [seed * 10 + i for i in range(BS)])
    block_hash = BlockHasher(NS, BS).hash_blocks(tokens)[0]
    key = mx.random.key(seed)
    arrays = {
        f"{layer}.{kind}": mx.random.normal((1, 2, BS, 8), key=key).astype(dtype) for layer in range(2) for kind in "kv"
    }
    mx.eval(list(arrays.values()))
    return block_hash, NS, tokens, arrays


def make_store(path, **kw) -> SSDStore:
    kw.setdefault("clock", FakeClock())
    return SSDStore(path, NS, **kw)


def bits(arr: mx.array) -> bytes:
    return np.asarray(arr.view(mx.uint8)).tobytes()


def files_under(path) -> list[str]:
    """Every file the store wrote under `path` but the folder's key (folder_key.py)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != KEY_FILE)


# --- save / load ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip_is_bit_for_bit(tmp_path, dtype):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1, dtype)
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SAVED
    assert (tmp_path / block_relpath(h)).is_file() and store.contains(h)
    loaded = store.load_block(h, tokens)
    assert loaded is not None
    assert loaded.token_ids == tuple(tokens) and loaded.parent_hash == parent
    assert sorted(loaded.arrays) == sorted(arrays)
    for name, arr in arrays.items():
        assert loaded.arrays[name].dtype == dtype and loaded.arrays[name].shape == arr.shape
        assert bits(loaded.arrays[name]) == bits(arr)
    stats = store.stats()
    assert (stats["ssd_saves"], stats["ssd_hits"], stats["ssd_blocks"]) == (1, 1, 1)
    assert stats["ssd_bytes"] == (tmp_path / block_relpath(h)).stat().st_size
    store.check_integrity()


def test_unknown_hash_and_wrong_tokens_are_misses(tmp_path):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1)
    assert store.load_block(h, tokens) is None
    store.save_block(h, parent, tokens, arrays)
    assert store.load_block(h, [9, 9, 9, 9]) is None  # tokens differ: a collision, the file stays
    assert store.contains(h) and store.load_block(h, tokens) is not None
    stats = store.stats()
    assert (stats["ssd_misses"], stats["ssd_collisions"], stats["ssd_corrupt"], stats["ssd_hits"]) == (2, 1, 0, 1)


def test_dedup_refreshes_last_access_and_writes_once(tmp_path):
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock)
    h, parent, tokens, arrays = block(1)
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SAVED
    clock.advance(100)
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.DEDUP
    assert store._index.get(h).last_accessed == clock.t
    assert store.stats()["ssd_saves"] == 1 and store.stats()["ssd_dedup"] == 1
    assert len(files_under(tmp_path)) == 1


def test_stale_index_entry_is_cleaned_and_saved_again(tmp_path):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1)
    store.save_block(h, parent, tokens, arrays)
    (tmp_path / block_relpath(h)).unlink()
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SAVED
    assert store.stats()["ssd_stale_cleaned"] == 1 and store.stats()["ssd_saves"] == 2
    assert store.load_block(h, tokens) is not None
    store.check_integrity()


def test_collision_isolates_the_hash_for_an_hour(tmp_path, caplog):
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock)
    h, parent, tokens, arrays = block(1)
    other = [7, 7, 7, 7]
    store.save_block(h, parent, tokens, arrays)
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve.kv.ssd.store"):
        assert store.save_block(h, parent, other, arrays) is SaveResult.COLLISION
        assert store.save_block(h, parent, other, arrays) is SaveResult.COLLISION
    assert sum("collision" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert store.stats()["ssd_collisions"] == 1 and store.stats()["ssd_isolated"] == 1
    (tmp_path / block_relpath(h)).unlink()  # the clashing file is gone, yet the hash stays isolated
    clock.advance(3599)
    assert store.save_block(h, parent, other, arrays) is SaveResult.COLLISION
    clock.advance(2)
    assert store.save_block(h, parent, other, arrays) is SaveResult.SAVED
    assert store.stats()["ssd_isolated"] == 0
    assert store.load_block(h, other) is not None


# --- damaged files -------------------------------------------------------------------------------


def _rewrite_metadata(path, **changes):
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, metadata={**meta, **changes})


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped_data_byte": _flip_last_byte,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-10]),
    "wrong_version": lambda p: _rewrite_metadata(p, version="99"),
    "wrong_namespace": lambda p: _rewrite_metadata(p, namespace=namespace_hash("x", "float32", BS).hex()),
    "tokens_edited": lambda p: _rewrite_metadata(p, token_ids=ssd_format.encode_tokens([0, 1, 2, 3])),
    "garbage": lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_is_a_miss_removed_and_counted(tmp_path, damage):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1)
    store.save_block(h, parent, tokens, arrays)
    path = tmp_path / block_relpath(h)
    DAMAGE[damage](path)
    assert store.load_block(h, tokens) is None
    assert not path.exists() and not store.contains(h)
    stats = store.stats()
    assert (stats["ssd_corrupt"], stats["ssd_misses"], stats["ssd_hits"], stats["ssd_bytes"]) == (1, 1, 0, 0)
    store.check_integrity()
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SAVED  # and it can be cached again


# --- validate_index ------------------------------------------------------------------------------


def copy_block(src_root, dst_root, block_hash):
    dst = dst_root / block_relpath(block_hash)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src_root / block_relpath(block_hash), dst)


def test_validate_index_reconciles_a_messy_folder(tmp_path):
    root, elsewhere = tmp_path / "kv", tmp_path / "other"
    store = make_store(root)
    blocks = [block(i) for i in range(4)]
    for b in blocks:
        store.save_block(*b)
    assert store.flush()
    (root / block_relpath(blocks[0][0])).unlink()  # missing file
    orphan, foreign = block(10), block(11)
    elsewhere.mkdir()
    shutil.copy(root / KEY_FILE, elsewhere / KEY_FILE)  # written under this folder's key (a file of another fails)
    make_store(elsewhere).save_block(*orphan)  # an orphan: a valid file the index never saw
    copy_block(elsewhere, root, orphan[0])
    SSDStore(elsewhere / "ns2", namespace_hash("x", "float32", BS), clock=FakeClock()).save_block(*foreign)
    copy_block(elsewhere / "ns2", root, foreign[0])  # a file of another namespace
    truncated = block(12)
    make_store(elsewhere).save_block(*truncated)
    copy_block(elsewhere, root, truncated[0])
    cut = root / block_relpath(truncated[0])
    cut.write_bytes(cut.read_bytes()[:-4])  # the header is intact, the arrays are not
    shard = (root / block_relpath(blocks[1][0])).parent
    (shard / "notes.txt").write_text("junk")
    misplaced = ("cd" if shard.name == "ab" else "ab") * 32
    (shard / f"{misplaced}.safetensors").write_bytes(b"misplaced")  # its name belongs in another shard
    (root / block_relpath(blocks[2][0])).write_bytes(b"\x00" * 40)  # corrupt indexed file
    (shard / f"{blocks[1][0].hex()}.7-0.tmp.safetensors").write_bytes(b"partial")
    (root / f"{INDEX_NAME}.7.tmp").write_bytes(b"{")

    reopened = make_store(root)
    report = reopened.validate_index()
    assert (report.kept, report.dropped_missing, report.adopted) == (2, 1, 1)
    assert (report.deleted_invalid, report.deleted_temp, report.evicted) == (5, 2, 0)
    assert sorted(h for h, _ in reopened._index.items()) == sorted([blocks[1][0], blocks[3][0], orphan[0]])
    assert reopened.load_block(orphan[0], orphan[2]) is not None
    reopened.check_integrity()
    assert files_under(root) == sorted([INDEX_NAME] + [block_relpath(b[0]) for b in (blocks[1], blocks[3], orphan)])


def test_validate_index_adopts_everything_after_index_loss(tmp_path):
    store = make_store(tmp_path)
    blocks = [block(i) for i in range(3)]
    for b in blocks:
        store.save_block(*b)
    (tmp_path / INDEX_NAME).write_text("{broken")
    reopened = make_store(tmp_path)
    assert reopened.stats()["ssd_blocks"] == 0
    report = reopened.validate_index()
    assert (report.adopted, report.kept, report.deleted_invalid) == (3, 0, 0)
    assert reopened.stats()["ssd_bytes"] == store.stats()["ssd_bytes"]
    assert all(reopened.load_block(h, t) is not None for h, _, t, _ in blocks)


# --- TTL, budget, free space ---------------------------------------------------------------------


def test_prune_expired_by_last_access_skips_pinned(tmp_path):
    clock = FakeClock()
    pinned: set[bytes] = set()
    store = make_store(tmp_path, clock=clock, ttl_s=7 * DAY, is_pinned=pinned.__contains__)
    a, b, c = block(1), block(2), block(3)
    store.save_block(*a)
    store.save_block(*b)
    clock.advance(3 * DAY)
    store.save_block(*c)
    assert store.load_block(b[0], b[2]) is not None  # a hit refreshes b
    pinned.add(a[0])
    clock.advance(5 * DAY)  # a is 8 days old but pinned; b was refreshed on day 3
    assert store.prune_expired() == 0
    pinned.clear()
    assert store.prune_expired() == 1 and not store.contains(a[0])
    assert store.prune_expired(now=clock.t + 2.5 * DAY) == 2
    assert store.stats()["ssd_pruned"] == 3 and store.stats()["ssd_blocks"] == 0
    assert files_under(tmp_path) == []


def test_disk_budget_evicts_least_recently_used_unpinned(tmp_path):
    probe = make_store(tmp_path / "probe")
    probe.save_block(*block(0))
    size = probe.stats()["ssd_bytes"]
    clock = FakeClock()
    pinned: set[bytes] = set()
    store = make_store(tmp_path / "kv", clock=clock, max_bytes=3 * size + size // 2, is_pinned=pinned.__contains__)
    blocks = [block(i) for i in range(5)]
    for b in blocks[:3]:
        clock.advance(1)
        store.save_block(*b)
    clock.advance(1)
    store.load_block(blocks[0][0], blocks[0][2])  # 0 is now the most recent; 1 is the oldest
    pinned.add(blocks[1][0])
    assert store.save_block(*blocks[3]) is SaveResult.SAVED
    assert not store.contains(blocks[2][0])  # 1 is pinned, so 2 went
    assert all(store.contains(blocks[i][0]) for i in (0, 1, 3))
    assert store.stats()["ssd_evictions"] == 1 and store.stats()["ssd_bytes"] <= store.max_bytes
    store.check_integrity()
    pinned.update(b[0] for b in blocks)
    assert store.save_block(*blocks[4]) is SaveResult.SKIPPED  # everything pinned: no room
    assert store.stats()["ssd_skipped_budget"] == 1 and store.stats()["ssd_blocks"] == 3
    assert not (tmp_path / "kv" / block_relpath(blocks[4][0])).exists()
    store.check_integrity()


def test_validate_index_fits_a_lowered_budget(tmp_path):
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock)
    blocks = [block(i) for i in range(4)]
    for b in blocks:
        clock.advance(1)
        store.save_block(*b)
    assert store.flush()
    size = store.stats()["ssd_bytes"] // 4
    pinned = {blocks[0][0]}  # the oldest, but pinned
    reopened = make_store(tmp_path, clock=clock, max_bytes=2 * size, is_pinned=pinned.__contains__)
    assert reopened.validate_index().evicted == 2
    assert [reopened.contains(b[0]) for b in blocks] == [True, False, False, True]
    reopened.check_integrity()


def test_free_space_floor_refuses_writes(tmp_path):
    free = {"bytes": 10**6}
    store = make_store(tmp_path, min_free_bytes=10**6, free_bytes=lambda _path: free["bytes"])
    h, parent, tokens, arrays = block(1)
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SKIPPED
    assert store.stats()["ssd_skipped_low_space"] == 1 and files_under(tmp_path) == []
    free["bytes"] = 10**9
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SAVED


def _raise(exc):
    def fail(*_args, **_kw):
        raise exc

    return fail


def _full_after(nbytes: int):
    """open_private whose file takes `nbytes` and then fails as a full disk does."""
    real = ssd_format.open_private

    class Filling:
        def __init__(self, f):
            self.f, self.left = f, nbytes

        def write(self, data):
            if len(memoryview(data).cast("B")) > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    return lambda path: Filling(real(path))


@pytest.mark.parametrize(
    "target, name, fail",
    [
        (ssd_format, "fsync_path", _raise(OSError(errno.ENOSPC, "No space left on device"))),
        (ssd_format.os, "replace", _raise(OSError(errno.ENOSPC, "No space left on device"))),
        (fsmode.os, "mkdir", _raise(PermissionError(errno.EACCES, "Permission denied"))),
        (ssd_format, "open_private", _raise(PermissionError(errno.EROFS, "Read-only file system"))),
        (ssd_format, "open_private", _full_after(100)),
    ],
)
def test_write_failure_is_an_error_and_leaves_nothing(tmp_path, monkeypatch, target, name, fail):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1)
    with monkeypatch.context() as patch:
        patch.setattr(target, name, fail)
        assert store.save_block(h, parent, tokens, arrays) is SaveResult.ERROR
    assert files_under(tmp_path) == []  # no temp file left behind
    assert store.stats()["ssd_errors"] == 1 and store.stats()["ssd_blocks"] == 0
    assert store.save_block(h, parent, tokens, arrays) is SaveResult.SAVED
    store.check_integrity()


# --- persistence ---------------------------------------------------------------------------------


def test_index_survives_a_restart(tmp_path):
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock)
    blocks = [block(i) for i in range(3)]
    for b in blocks:
        clock.advance(1)
        store.save_block(*b)
    clock.advance(1)
    store.load_block(blocks[0][0], blocks[0][2])
    assert store.flush()
    reopened = make_store(tmp_path, clock=clock)
    assert list(reopened._index.items()) == list(store._index.items())  # entries and LRU order
    assert reopened.stats()["ssd_bytes"] == store.stats()["ssd_bytes"]
    assert all(reopened.load_block(h, t) is not None for h, _, t, _ in blocks)
    reopened.check_integrity()


def test_maybe_flush_batches_index_writes(tmp_path):
    clock = FakeClock()
    store = make_store(tmp_path, clock=clock)
    store.save_block(*block(1))
    clock.advance(0.5)
    assert store.maybe_flush(1.0) and not (tmp_path / INDEX_NAME).exists()
    clock.advance(0.5)
    assert store.maybe_flush(1.0) and (tmp_path / INDEX_NAME).exists()
    assert make_store(tmp_path).contains(block(1)[0])


def test_check_integrity_catches_a_missing_file(tmp_path):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1)
    store.save_block(h, parent, tokens, arrays)
    store.check_integrity()
    (tmp_path / block_relpath(h)).unlink()
    with pytest.raises(AssertionError, match="no file"):
        store.check_integrity()
