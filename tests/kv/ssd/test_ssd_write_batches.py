"""Issue 14 item 4 without a model: batched saves (SSDStore.save_blocks, the writer's batches), a
kill -9 in the middle of a batch, shedding under overload, and the sized, value-ordered drain."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.ssd import format as ssd_format
from mlx_kvserve.kv.ssd.format import TEMP_SUFFIX, block_relpath
from mlx_kvserve.kv.ssd.store import BlockToSave, SaveResult, SSDStore
from mlx_kvserve.kv.ssd.tier import SSDTier
from mlx_kvserve.kv.ssd.write_queue import JobValue, WriteQueue
from mlx_kvserve.kv.ssd.writer import SSDWriterThread, WriteJob

BS = 4
NS = namespace_hash("m", "float32", BS)
ROOT = Path(__file__).resolve().parents[3]


def chain(n: int, seed: int = 0) -> list[BlockToSave]:
    """The first n blocks of one prompt (hash chain), with small random arrays."""
    tokens = [seed * 1000 + t for t in range(n * BS)]
    hashes = BlockHasher(NS, BS).hash_blocks(tokens)
    out = []
    for i, block_hash in enumerate(hashes):
        key = mx.random.key(seed * 1000 + i)  # the same arrays in every process
        arrays = {f"{layer}.{kind}": mx.random.normal((1, 2, BS, 8), key=key) for layer in range(2) for kind in "kv"}
        mx.eval(list(arrays.values()))
        out.append(BlockToSave(block_hash, hashes[i - 1] if i else NS, tokens[i * BS : (i + 1) * BS], arrays))
    return out


def job(b: BlockToSave, depth: int = 0) -> WriteJob:
    return WriteJob(*b, depth=depth)


def loads(store: SSDStore, b: BlockToSave) -> bool:
    loaded = store.load_block(b.block_hash, b.token_ids)
    return loaded is not None and all(mx.array_equal(loaded.arrays[k], b.arrays[k]).item() for k in b.arrays)


# --- SSDStore.save_blocks --------------------------------------------------------------------------


def test_a_batch_saves_every_new_block_and_answers_each_in_order(tmp_path):
    store = SSDStore(tmp_path, NS)
    blocks = chain(6)
    assert store.save_block(*blocks[2]) is SaveResult.SAVED  # already there: a dedup inside the batch
    other = chain(1, seed=7)[0]
    collision = BlockToSave(blocks[4].block_hash, blocks[4].parent_hash, other.token_ids, other.arrays)
    batch = [*blocks[:4], collision, blocks[5], blocks[5]]  # the same hash twice: written once
    results = store.save_blocks(batch)
    saved, dedup = SaveResult.SAVED, SaveResult.DEDUP
    assert results == [saved, saved, dedup, saved, saved, saved, dedup]
    assert store.save_blocks([blocks[4]]) == [SaveResult.COLLISION]  # the hash now holds the other tokens
    assert all(loads(store, b) for b in [*blocks[:4], blocks[5]])
    assert store.stats()["ssd_saves"] == 6 and store.stats()["ssd_blocks"] == 6  # one before the batch, five in it
    assert not list(tmp_path.rglob(f"*{TEMP_SUFFIX}"))
    store.check_integrity()


def test_a_failed_fsync_fails_only_its_own_block(tmp_path, monkeypatch):
    store = SSDStore(tmp_path, NS)
    blocks = chain(5)
    real_fsync = ssd_format.fsync_path
    doomed = blocks[2].block_hash.hex()

    def fsync(path):
        if path.name.startswith(doomed):
            raise OSError(5, "Input/output error")
        real_fsync(path)

    monkeypatch.setattr(ssd_format, "fsync_path", fsync)
    results = store.save_blocks(blocks)
    assert results == [SaveResult.SAVED] * 2 + [SaveResult.ERROR] + [SaveResult.SAVED] * 2
    assert store.stats()["ssd_errors"] == 1 and not store.contains(blocks[2].block_hash)
    assert not list(tmp_path.rglob(f"*{TEMP_SUFFIX}"))  # the failed file is gone
    store.check_integrity()


def test_no_block_enters_the_index_before_every_file_of_its_batch_is_fsyncd(tmp_path, monkeypatch):
    store = SSDStore(tmp_path, NS)
    blocks = chain(4)
    seen: list[tuple[str, int]] = []
    real_fsync, real_replace = ssd_format.fsync_path, os.replace

    def fsync(path):
        seen.append(("fsync", store.stats()["ssd_blocks"]))
        real_fsync(path)

    def replace(src, dst):
        seen.append(("rename", len(store._index)))  # called under the store's lock: read the index itself
        real_replace(src, dst)

    monkeypatch.setattr(ssd_format, "fsync_path", fsync)
    monkeypatch.setattr(ssd_format.os, "replace", replace)
    assert store.save_blocks(blocks) == [SaveResult.SAVED] * 4
    kinds = [kind for kind, _ in seen]
    assert kinds[:4] == ["fsync"] * 4 and kinds[4:8] == ["rename"] * 4  # then the folder fsyncs
    assert all(n == 0 for kind, n in seen[:4])  # nothing indexed while files were being made durable


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from test_ssd_write_batches import chain, NS
    from mlx_kvserve.kv.ssd import format as ssd_format
    from mlx_kvserve.kv.ssd.store import SSDStore
    store = SSDStore({folder!r}, NS)
    blocks = chain(6)
    phase, count = {phase!r}, {{"n": 0}}
    real_fsync, real_replace = ssd_format.fsync_path, os.replace

    def maybe_die(kind):
        if kind == phase:
            count["n"] += 1
            if count["n"] == 3:  # in the middle of the batch
                os.kill(os.getpid(), signal.SIGKILL)

    def fsync(path):
        maybe_die("fsync")
        real_fsync(path)

    def replace(src, dst):
        maybe_die("rename")
        real_replace(src, dst)

    ssd_format.fsync_path, ssd_format.os.replace = fsync, replace
    store.save_blocks(blocks)
    """
)


@pytest.mark.parametrize("phase, expected_blocks", [("fsync", 0), ("rename", 2)])
def test_kill9_in_the_middle_of_a_batch_serves_nothing_torn(tmp_path, phase, expected_blocks):
    """A process killed while it fsyncs (or renames) a batch: after a restart the folder holds only
    whole, verified blocks (those renamed before the kill) and no temp file."""
    folder = tmp_path / "store"
    script = _CHILD.format(root=str(ROOT), tests=str(Path(__file__).resolve().parent), folder=str(folder), phase=phase)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert list(folder.rglob(f"*{TEMP_SUFFIX}"))  # the kill left temp files behind
    store = SSDStore(folder, NS)
    report = store.validate_index()
    assert report.deleted_temp >= 1 and report.deleted_invalid == 0
    blocks = chain(6)
    served = [b for b in blocks if store.contains(b.block_hash)]
    assert len(served) == expected_blocks
    assert all(loads(store, b) for b in served)  # every block that is served is whole
    assert store.stats()["ssd_corrupt"] == 0
    assert not list(folder.rglob(f"*{TEMP_SUFFIX}"))
    store.check_integrity()


def test_a_truncated_file_from_a_batch_is_a_miss(tmp_path):
    store = SSDStore(tmp_path, NS)
    blocks = chain(3)
    store.save_blocks(blocks)
    path = tmp_path / block_relpath(blocks[1].block_hash)
    path.write_bytes(path.read_bytes()[:-100])
    assert store.load_block(blocks[1].block_hash, blocks[1].token_ids) is None
    assert loads(store, blocks[0]) and loads(store, blocks[2])
    assert store.stats()["ssd_corrupt"] == 1


# --- the writer's batches ------------------------------------------------------------------------


class GatedBatches:
    """A save_batch that records each batch and waits at `gate` (set: open) before answering."""

    def __init__(self):
        self.batches: list[list[bytes]] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def __call__(self, jobs):
        self.batches.append([j.block_hash for j in jobs])
        self.started.set()
        assert self.gate.wait(10)
        return [SaveResult.SAVED] * len(jobs)


def fake(i: int, depth: int = 0, nbytes: int = 0) -> WriteJob:
    arrays = {"a": mx.zeros((nbytes // 4,), dtype=mx.float32)} if nbytes else {}
    return WriteJob(i.to_bytes(32, "big"), NS, (i,) * BS, arrays, depth)


def test_jobs_queued_while_a_batch_is_saved_go_in_the_next_batch_oldest_first():
    save = GatedBatches()
    writer = SSDWriterThread(save_batch=save, max_batch_jobs=32)
    assert writer.enqueue(fake(0)) and save.started.wait(5)
    for i in range(1, 11):
        assert writer.enqueue(fake(i))
    save.gate.set()
    assert writer.stop(5)
    assert save.batches == [[fake(0).block_hash], [fake(i).block_hash for i in range(1, 11)]]
    stats = writer.stats()
    assert stats["writer_batches"] == 2 and stats["writer_written"] == 11 and stats["writer_pending"] == 0


def test_batches_respect_the_job_and_byte_limits():
    save = GatedBatches()
    writer = SSDWriterThread(save_batch=save, max_batch_jobs=4, max_batch_bytes=3000)
    writer.hold(30)
    for i in range(10):
        assert writer.enqueue(fake(i, nbytes=1000))
    save.gate.set()
    writer.resume()
    assert writer.stop(5)
    assert [len(b) for b in save.batches] == [3, 3, 3, 1]  # 3 x 1000 bytes fit, a 4th would not


def test_a_failed_job_in_a_batch_is_retried_alone_under_persistent():
    calls: list[list[bytes]] = []

    def save_batch(jobs):
        calls.append([j.block_hash for j in jobs])
        return [
            SaveResult.ERROR if j.block_hash == fake(2).block_hash and len(calls) < 3 else SaveResult.SAVED
            for j in jobs
        ]

    writer = SSDWriterThread(save_batch=save_batch, durability="persistent", retry_backoff_s=0.0)
    writer.hold(30)
    for i in range(4):
        writer.enqueue(fake(i))
    writer.resume()
    assert writer.stop(5)
    assert calls[0] == [fake(i).block_hash for i in range(4)]
    assert calls[1:] == [[fake(2).block_hash], [fake(2).block_hash]]  # failed once more, then saved
    stats = writer.stats()
    assert (stats["writer_written"], stats["writer_retries"], stats["writer_failures"]) == (4, 2, 0)


def test_the_writer_measures_its_bandwidth():
    def save_batch(jobs):
        time.sleep(0.05)
        return [SaveResult.SAVED] * len(jobs)

    writer = SSDWriterThread(save_batch=save_batch)
    assert writer.stats()["writer_bandwidth_mib_s"] == 0.0  # nothing measured yet
    writer.hold(30)
    for i in range(4):
        writer.enqueue(fake(i, nbytes=1 << 20))
    writer.resume()
    assert writer.stop(5)
    mib_s = writer.stats()["writer_bandwidth_mib_s"]
    assert 0 < mib_s <= 4 / 0.05  # 4 MiB in one batch of at least 50 ms


# --- shedding ------------------------------------------------------------------------------------


def test_a_full_queue_sheds_the_deepest_unpinned_job_and_never_a_pinned_one():
    pinned = {fake(i).block_hash for i in (10, 11)}
    queue = WriteQueue(3, lambda j: JobValue(j.block_hash in pinned, j.depth))
    assert all(queue.put(fake(i, depth=d), 0) for i, d in [(0, 0), (1, 5), (10, 9)])
    queued, dropped = queue.put_shedding(fake(2, depth=1), 0)
    assert queued and dropped.job == fake(1, depth=5)  # deepest unpinned, pinned 10 is deeper
    queued, dropped = queue.put_shedding(fake(3, depth=7), 0)
    assert not queued and dropped.job == fake(3, depth=7)  # the new job is the deepest
    queued, dropped = queue.put_shedding(fake(4, depth=1), 0)
    assert not queued and dropped.job == fake(4, depth=1)  # a tie with job 2: the newest goes
    queue = WriteQueue(1, lambda j: JobValue(j.block_hash in pinned, j.depth))
    assert queue.put(fake(10), 0)
    assert queue.put_shedding(fake(11), 0) == (False, None)  # only pinned jobs: nothing may go


def _tier(tmp_path, pins: set[bytes], queue_size: int) -> SSDTier:
    store = SSDStore(tmp_path, NS, is_pinned=pins.__contains__)
    holder: list[SSDTier] = []
    writer = SSDWriterThread(
        save_batch=lambda jobs: holder[0].save_jobs(jobs),
        queue_size=queue_size,
        when_full="shed",
        value=lambda j: holder[0].job_value(j),
        on_shed=lambda j: holder[0].forget_job(j),
    )
    tier = SSDTier(store, writer, "write_through", to_arrays=lambda p: p, from_arrays=lambda a: (a, 0))
    holder.append(tier)
    return tier


def test_under_overload_the_tier_sheds_deep_unpinned_blocks_and_writes_pinned_and_shallow_ones(tmp_path):
    """A tiny queue (4) held while two chains arrive: a pinned system prompt (depths 0-3) and a
    conversation (depths 0-7). What is shed is the conversation's deep end; the pinned chain and the
    shallow blocks reach the disk, and /health's counters say how many were shed."""
    from mlx_kvserve.kv.base import Block

    system, talk = chain(4, seed=1), chain(8, seed=2)
    pins = {b.block_hash for b in system}
    tier = _tier(tmp_path, pins, queue_size=6)
    tier.writer.hold(60)  # the disk "cannot keep up": nothing leaves the queue
    for depth, b in [*enumerate(talk[:4]), *enumerate(system), *((d + 4, b) for d, b in enumerate(talk[4:]))]:
        tier.on_new_block(Block(b.block_hash, b.parent_hash, tuple(b.token_ids), b.arrays, 0, depth=depth))
    tier.save_tail(talk[-1].block_hash, [1, 2], {"0.k": mx.zeros((1, 2, 2, 8))})  # a tail: shed first
    stats = tier.stats()
    assert stats["writer_shed"] == 12 - 6 + 1 and stats["writer_shed_bytes"] > 0  # 12 blocks, room for 6, a tail
    assert stats["writer_sync_fallbacks"] == 0  # no request thread wrote anything itself
    assert tier.close(drain_timeout_s=30)
    written = {b.block_hash for b in [*system, *talk] if tier.store.contains(b.block_hash)}
    assert pins <= written  # every pinned block
    assert {b.block_hash for b in talk[:2]} <= written  # the conversation's shallowest blocks
    assert not written & {b.block_hash for b in talk[2:]}  # its deep end was shed
    assert tier.stats()["ssd_tail_saves"] == 0 and not tier._tail_keys  # the shed tail was forgotten


def test_a_queue_full_of_pinned_blocks_makes_the_caller_write_the_next_one(tmp_path):
    blocks = chain(3, seed=3)
    tier = _tier(tmp_path, {b.block_hash for b in blocks}, queue_size=1)
    tier.writer.hold(60)
    for b in blocks:
        tier.writer.enqueue(job(b))
    stats = tier.stats()
    assert stats["writer_shed"] == 0 and stats["writer_sync_fallbacks"] == 2
    assert tier.close(drain_timeout_s=30)
    assert all(tier.store.contains(b.block_hash) for b in blocks)


# --- the drain -----------------------------------------------------------------------------------


def test_the_drain_logs_its_estimate_and_writes_everything_in_the_time_it_asked_for(tmp_path, caplog):
    store = SSDStore(tmp_path, NS)
    blocks = chain(24, seed=4)
    writer = SSDWriterThread(save_batch=store.save_blocks, max_batch_jobs=4)
    for b in blocks[:4]:  # one batch measured first
        writer.enqueue(job(b))
    assert writer.wait_idle(10) == 0 and writer.bandwidth.bytes_per_s() > 0
    writer.hold(60)
    for depth, b in enumerate(blocks[4:]):
        writer.enqueue(job(b, depth))
    estimate = writer.drain_estimate()
    assert estimate.num_jobs == 20 and estimate.nbytes == sum(b.arrays["0.k"].nbytes * 4 for b in blocks[4:])
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.kv.ssd.writer"):
        assert writer.stop(estimate.asked_s)
    assert "draining 20 blocks" in caplog.text and "estimated" in caplog.text
    assert all(loads(store, b) for b in blocks)
    store.check_integrity()


def test_a_drain_cut_short_writes_the_most_valuable_jobs_first():
    done: list[bytes] = []

    def save_batch(jobs):
        time.sleep(0.05)
        done.extend(j.block_hash for j in jobs)
        return [SaveResult.SAVED] * len(jobs)

    pinned = fake(99, depth=30)
    writer = SSDWriterThread(
        save_batch=save_batch, max_batch_jobs=1, value=lambda j: JobValue(j.block_hash == pinned.block_hash, j.depth)
    )
    writer.hold(60)
    depths = [7, 3, 9, 0, 5, 1, 8]
    for i, d in enumerate(depths):
        writer.enqueue(fake(i, depth=d))
    writer.enqueue(pinned)
    assert not writer.stop(0.12)  # time for 2-3 of 8 jobs; the rest is dropped (tests/kv/ssd/test_ssd_drain.py)
    assert not writer.is_alive
    assert 2 <= len(done) < 8
    written = [pinned.block_hash] + [fake(depths.index(d)).block_hash for d in sorted(depths)]
    assert done == written[: len(done)]  # pinned first, then the shallowest
    assert writer.stats()["writer_dropped_at_stop"] == 8 - len(done)


def test_a_hold_that_begins_during_a_batch_pauses_it_after_the_file_in_progress(tmp_path, monkeypatch):
    """A request that starts prefilling while the writer saves a batch gets the cores back after the
    file being written: the batch's next file waits for the hold's end (resume), then the batch
    completes, every block durable and loadable. A save on another thread never waits on a hold."""
    from mlx_kvserve.kv.base import Block

    blocks = chain(5, seed=4)
    tier = _tier(tmp_path, set(), queue_size=16)
    store, writer = tier.store, tier.writer
    writing, go = threading.Event(), threading.Event()
    written: list[bytes] = []
    real = store._write_unsynced

    def first_waits(block):
        if not written:
            writing.set()
            assert go.wait(10)
        written.append(block.block_hash)
        return real(block)

    monkeypatch.setattr(store, "_write_unsynced", first_waits)
    writer.hold(60)  # the blocks go to the writer as one batch once the hold ends
    for depth, b in enumerate(blocks):
        tier.on_new_block(Block(b.block_hash, b.parent_hash, tuple(b.token_ids), b.arrays, 0, depth=depth))
    writer.resume()
    assert writing.wait(10)  # the batch's first file is being written
    writer.hold(60)  # a request begins prefilling
    go.set()
    time.sleep(0.3)
    assert written == [blocks[0].block_hash]  # the rest of the batch waits
    writer.pause_point()  # on this thread: returns at once, held or not
    writer.resume()  # the request's first token
    assert writer.wait_idle(10) == 0
    assert written == [b.block_hash for b in blocks]
    assert all(loads(store, b) for b in blocks)
    assert writer.stats()["writer_held"] >= 1  # counted (inside the batch; before it too when the writer woke in time)
    assert writer.stop(5)
