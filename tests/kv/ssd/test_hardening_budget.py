"""Issue 17, items 6 and 8: every byte the SSD tier writes counts in its budget and free-space
floor (tails included), and a shutdown is clean only when the index reached the disk too."""

from pathlib import Path

import kvharness
import mlx.core as mx

from mlx_kvserve.kv.base import Block
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.ssd.index import INDEX_NAME
from mlx_kvserve.kv.ssd.shutdown_record import SHUTDOWN_FILE, read_shutdown_record
from mlx_kvserve.kv.ssd.store import SaveResult, SSDStore
from mlx_kvserve.kv.ssd.tier import SSDTier
from mlx_kvserve.kv.ssd.writer import SSDWriterThread

BS = 8
NS = namespace_hash("budget-model", "float32", BS)


def arrays(n: int, seed: int) -> dict:
    mx.random.seed(seed)
    out = {"0.k": mx.random.normal((1, 4, n, 64)), "0.v": mx.random.normal((1, 4, n, 64))}
    mx.eval(list(out.values()))
    return out


def make_tier(folder: Path, max_bytes: int = 0, free_bytes=None) -> SSDTier:
    kwargs = {"free_bytes": free_bytes} if free_bytes else {}
    store = SSDStore(folder, NS, max_bytes=max_bytes, min_free_bytes=1 << 20, **kwargs)
    store.validate_index()
    holder: list[SSDTier] = []
    writer = SSDWriterThread(lambda *job: holder[0].save_job(*job))
    tier = SSDTier(store, writer, "write_through", dict, lambda a: (a, 0), async_writes=False)
    holder.append(tier)
    kvharness.OPEN_TIERS.append(tier)  # its non-daemon writer is stopped even when a test fails
    return tier


def disk_bytes(folder: Path) -> int:
    """Every byte of block and tail files under the store's folder, measured on disk."""
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def block(i: int) -> Block:
    return Block((1000 + i).to_bytes(32, "big"), NS, tuple(range(i, i + BS)), arrays(BS, i), 0)


def test_tails_count_in_the_disk_budget(tmp_path):
    one_block = 2 * 4 * BS * 64 * 4  # two float32 arrays of one block
    budget = 6 * one_block
    tier = make_tier(tmp_path, max_bytes=budget)
    for i in range(4):
        tier.on_new_block(block(i))
    for i in range(40):  # far more tails than the budget holds: older files must make room
        tier.save_tail(i.to_bytes(32, "big"), list(range(i, i + 7)), arrays(7, 100 + i))
    assert tier.tails.stats["ssd_tail_saves"] >= 10
    assert disk_bytes(tmp_path) <= budget, (disk_bytes(tmp_path), budget)
    assert tier.store.used_bytes() == disk_bytes(tmp_path)
    assert tier.stats()["ssd_tail_bytes"] == disk_bytes(tmp_path / "tails")
    tier.store.check_integrity()
    # The newest tail survived the LRU: it is served.
    assert tier.load_tail((39).to_bytes(32, "big"), list(range(39, 39 + 7))) is not None
    tier.writer.stop(5)


def test_a_block_evicts_older_tails_first_and_budget_holds(tmp_path):
    one_block = 2 * 4 * BS * 64 * 4
    budget = 3 * one_block + 4096
    tier = make_tier(tmp_path, max_bytes=budget)
    for i in range(6):
        tier.save_tail(i.to_bytes(32, "big"), list(range(i, i + 7)), arrays(7, i))
    for i in range(3):
        tier.on_new_block(block(i))
    assert disk_bytes(tmp_path) <= budget
    assert all(tier.store.contains(block(i).block_hash) for i in range(3))  # the newer blocks won
    tier.store.check_integrity()
    tier.writer.stop(5)


def test_tails_respect_the_free_space_floor(tmp_path):
    tier = make_tier(tmp_path, free_bytes=lambda _path: 512 * 1024)  # below the 1 MiB floor
    tier.save_tail(b"\x01" * 32, [1, 2, 3], arrays(3, 0))
    tier.on_new_block(block(0))
    stats = tier.stats()
    assert stats["ssd_tail_skipped_low_space"] == 1 and stats["ssd_skipped_low_space"] == 1
    assert stats["ssd_tail_saves"] == 0 and disk_bytes(tmp_path) == 0
    tier.writer.stop(5)


def test_tail_write_failures_count_as_write_errors(tmp_path):
    tier = make_tier(tmp_path)
    (tmp_path / "tails").write_text("a file where the tails folder belongs")
    assert tier.tails.save(b"\x01" * 32, [1, 2], arrays(2, 0)) is SaveResult.ERROR
    assert tier.stats()["ssd_tail_write_errors"] == 1
    tier.writer.stop(5)


def test_shutdown_is_not_clean_when_the_index_write_fails(tmp_path):
    tier = make_tier(tmp_path)
    tier.on_new_block(block(0))
    (tmp_path / INDEX_NAME).unlink(missing_ok=True)
    (tmp_path / INDEX_NAME).mkdir()  # index.json replaced by a folder: the final index write fails
    assert tier.close(drain_timeout_s=5) is False
    assert read_shutdown_record(tmp_path)["shutdown_clean"] is False


def test_shutdown_is_clean_when_everything_reached_the_disk(tmp_path):
    tier = make_tier(tmp_path)
    tier.on_new_block(block(0))
    assert tier.close(drain_timeout_s=5) is True
    assert (tmp_path / SHUTDOWN_FILE).exists()
    assert read_shutdown_record(tmp_path)["shutdown_clean"] is True


def test_a_store_folder_deleted_while_running_is_recreated_by_the_next_write(tmp_path):
    import shutil

    folder = tmp_path / "ns"
    tier = make_tier(folder)
    shutil.rmtree(folder)
    tier.on_new_block(block(0))  # the free-space check must not fail on the missing folder
    assert tier.store.stats()["ssd_saves"] == 1 and tier.store.contains(block(0).block_hash)
    assert (folder.stat().st_mode & 0o777) == 0o700
    tier.save_tail(b"\x01" * 32, [1, 2, 3], arrays(3, 0))
    assert tier.stats()["ssd_tail_saves"] == 1


def test_budget_eviction_never_deletes_through_a_linked_tails_folder(tmp_path):
    outside = tmp_path / "model"
    outside.mkdir()
    victim = outside / ("ab" * 32 + ".safetensors")  # named like a tail, in a folder we do not own
    victim.write_bytes(b"x" * 100_000)
    tier = make_tier(tmp_path / "ns", max_bytes=50_000)
    (tmp_path / "ns" / "tails").mkdir()
    (tmp_path / "ns" / "tails" / ("cd" * 32)).symlink_to(outside)
    tier.on_new_block(block(0))
    tier.save_tail(b"\x01" * 32, [1, 2, 3], arrays(3, 0))
    assert victim.exists()
    assert tier.tails.save(bytes.fromhex("cd" * 32), [4, 5], arrays(2, 0)) is SaveResult.ERROR  # not through the link
    assert sorted(p.name for p in outside.iterdir()) == [victim.name]


def test_wait_idle_returns_once_queued_writes_are_done(tmp_path):
    """An admin flush with ssd=true waits for writes queued before it (else they land after it)."""
    import threading

    from mlx_kvserve.kv.ssd.writer import WriteJob

    gate = threading.Event()
    saved = []

    def slow_save(*job):
        gate.wait(5)
        saved.append(job[0])
        return SaveResult.SAVED

    writer = SSDWriterThread(slow_save)
    try:
        writer.enqueue(WriteJob(b"\x01" * 32, NS, (1,), {}))
        assert writer.wait_idle(0.2) == 1  # still being saved: the wait ran out
        threading.Timer(0.2, gate.set).start()
        assert writer.wait_idle(5) == 0 and saved == [b"\x01" * 32]
    finally:
        gate.set()
        writer.stop(5)
