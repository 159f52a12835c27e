"""SSDWriterThread with an injected save function (slow, failing, gated) and with a real SSDStore."""

import sys
import threading
import time

import mlx.core as mx
import pytest

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.ssd.index import INDEX_NAME
from mlx_kvserve.kv.ssd.store import SaveResult, SSDStore
from mlx_kvserve.kv.ssd.writer import SSDWriterThread, WriteJob

BS = 4
NS = namespace_hash("m", "float32", BS)


def job(i: int) -> WriteJob:
    return WriteJob(i.to_bytes(32, "big"), NS, (i, i, i, i), {})


class FakeSave:
    """Records every call. `results` scripts the answers per hash (default SAVED); `gate`, when
    set up, holds calls on the given threads until released."""

    def __init__(self, results=None, gate_threads=("ssd-writer",)):
        self.calls: list[tuple[bytes, str]] = []
        self.lock = threading.Lock()
        self.results = results or (lambda block_hash, attempt: SaveResult.SAVED)
        self.gate = threading.Event()
        self.gate.set()
        self.gate_threads = gate_threads
        self.started = threading.Event()

    def __call__(self, block_hash, parent_hash, token_ids, arrays):
        with self.lock:
            attempt = sum(1 for h, _ in self.calls if h == block_hash)
            self.calls.append((block_hash, threading.current_thread().name))
        self.started.set()
        if threading.current_thread().name in self.gate_threads:
            assert self.gate.wait(10)
        return self.results(block_hash, attempt)

    def hashes(self) -> list[bytes]:
        with self.lock:
            return [h for h, _ in self.calls]


def test_same_hash_enqueued_many_times_is_written_once():
    save = FakeSave()
    save.gate.clear()
    writer = SSDWriterThread(save)
    assert writer.enqueue(job(1))
    assert [writer.enqueue(job(1)) for _ in range(9)] == [False] * 9  # pending: queued or being saved
    save.gate.set()
    assert writer.stop(5)
    assert save.hashes() == [job(1).block_hash]
    stats = writer.stats()
    assert (stats["writer_enqueued"], stats["writer_dedup_pending"], stats["writer_written"]) == (1, 9, 1)
    assert stats["writer_pending"] == 0 and stats["writer_queue_depth"] == 0


def test_write_through_into_a_real_store(tmp_path):
    store = SSDStore(tmp_path, NS)
    hasher = BlockHasher(NS, BS)
    blocks = []
    for i in range(5):
        tokens = [i * 10 + t for t in range(BS)]
        arrays = {"0.k": mx.random.normal((1, 2, BS, 8)), "0.v": mx.random.normal((1, 2, BS, 8))}
        mx.eval(list(arrays.values()))
        blocks.append(WriteJob(hasher.hash_blocks(tokens)[0], NS, tokens, arrays))
    writer = SSDWriterThread(store.save_block, after_job=lambda: store.maybe_flush(0.0))
    assert all(writer.enqueue(b) for b in blocks)
    assert writer.stop(5)
    assert writer.stats()["writer_written"] == 5 and store.stats()["ssd_saves"] == 5
    for b in blocks:
        loaded = store.load_block(b.block_hash, b.token_ids)
        assert loaded is not None and mx.array_equal(loaded.arrays["0.k"], b.arrays["0.k"]).item()
    assert SSDStore(tmp_path, NS).stats()["ssd_blocks"] == 5  # the hook flushed the index
    assert (tmp_path / INDEX_NAME).exists()
    store.check_integrity()
    again = SSDWriterThread(store.save_block)
    assert again.enqueue(blocks[0]) and again.stop(5)
    assert again.stats()["writer_declined"] == 1 and store.stats()["ssd_dedup"] == 1


def test_concurrent_producers_lose_no_counts():
    save = FakeSave()
    writer = SSDWriterThread(save, queue_size=8, put_timeout_s=0.001)
    num_threads, per_thread = 8, 250

    def produce(t):
        for i in range(per_thread):
            assert writer.enqueue(job(t * per_thread + i))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.stop(10)
    total = num_threads * per_thread
    stats = writer.stats()
    assert stats["writer_enqueued"] == total and stats["writer_written"] == total
    assert stats["writer_immediate_puts"] + stats["writer_timeout_puts"] + stats["writer_sync_fallbacks"] == total
    assert sorted(save.hashes()) == sorted(job(i).block_hash for i in range(total))


def test_stop_racing_producers_loses_nothing_and_runs_nothing_after_the_sentinel():
    save = FakeSave(results=lambda h, a: time.sleep(0.0002) or SaveResult.SAVED)
    writer = SSDWriterThread(save, queue_size=16, put_timeout_s=0.001)
    accepted: list[list[bytes]] = [[] for _ in range(6)]
    refused = [0] * 6
    running = threading.Event()
    running.set()

    def produce(t):
        i = 0
        while running.is_set():
            j = job(t * 1_000_000 + i)
            if writer.enqueue(j):
                accepted[t].append(j.block_hash)
            else:
                refused[t] += 1
            i += 1

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert writer.stop(10)
    assert not writer.is_alive
    calls_at_stop = len(save.hashes())
    time.sleep(0.05)  # producers keep trying after the stop
    running.clear()
    for t in threads:
        t.join()
    all_accepted = [h for chunk in accepted for h in chunk]
    assert len(save.hashes()) == calls_at_stop  # nothing ran after the sentinel
    assert sorted(save.hashes()) == sorted(all_accepted)  # every accepted job was saved, once
    stats = writer.stats()
    assert stats["writer_queue_depth"] == 0 and stats["writer_written"] == len(all_accepted)
    assert stats["writer_dropped_after_close"] == sum(refused) > 0


def test_backpressure_short_wait_level():
    save = FakeSave()
    save.gate.clear()
    writer = SSDWriterThread(save, queue_size=1, put_timeout_s=2.0)
    assert writer.enqueue(job(1)) and save.started.wait(5)  # the worker holds job 1
    assert writer.enqueue(job(2))  # takes the only slot
    waiter = threading.Thread(target=writer.enqueue, args=(job(3),))
    waiter.start()
    time.sleep(0.5)  # job 3 is now waiting for a slot
    save.gate.set()  # the worker moves on, a slot frees up within the wait
    waiter.join(5)
    assert writer.stop(5)
    stats = writer.stats()
    assert (stats["writer_immediate_puts"], stats["writer_timeout_puts"], stats["writer_sync_fallbacks"]) == (2, 1, 0)
    assert save.hashes() == [job(i).block_hash for i in (1, 2, 3)]


def test_backpressure_falls_back_to_a_synchronous_save():
    save = FakeSave()
    save.gate.clear()
    writer = SSDWriterThread(save, queue_size=1, put_timeout_s=0.05)
    assert writer.enqueue(job(1)) and save.started.wait(5)
    assert writer.enqueue(job(2))
    start = time.monotonic()
    assert writer.enqueue(job(3))  # queue full for the whole 50 ms: saved on this thread
    assert time.monotonic() - start >= 0.05
    assert save.calls[-1] == (job(3).block_hash, threading.current_thread().name)
    save.gate.set()
    assert writer.stop(5)
    stats = writer.stats()
    assert (stats["writer_immediate_puts"], stats["writer_timeout_puts"], stats["writer_sync_fallbacks"]) == (2, 0, 1)
    assert stats["writer_written"] == 3 and sorted(save.hashes()) == sorted(job(i).block_hash for i in (1, 2, 3))


def always_error(block_hash, attempt):
    return SaveResult.ERROR


def fail_twice(block_hash, attempt):
    return SaveResult.ERROR if attempt < 2 else SaveResult.SAVED


@pytest.mark.parametrize(
    "durability, results, calls, retries, failures, written",
    [
        ("best_effort", always_error, 1, 0, 1, 0),
        ("persistent", always_error, 4, 3, 1, 0),
        ("best_effort", fail_twice, 1, 0, 1, 0),
        ("persistent", fail_twice, 3, 2, 0, 1),
    ],
)
def test_durability_policies_on_failures(durability, results, calls, retries, failures, written):
    save = FakeSave(results=results)
    writer = SSDWriterThread(save, durability=durability, max_retries=3, retry_backoff_s=0.0)
    assert writer.enqueue(job(1))
    assert writer.stop(5)
    stats = writer.stats()
    assert len(save.calls) == calls
    assert (stats["writer_retries"], stats["writer_failures"], stats["writer_written"]) == (retries, failures, written)


def test_a_raising_save_is_a_failure_and_the_writer_survives():
    def results(block_hash, attempt):
        if block_hash == job(1).block_hash:
            raise OSError("permission denied")
        return SaveResult.SAVED

    save = FakeSave(results=results)
    writer = SSDWriterThread(save)
    assert writer.enqueue(job(1)) and writer.enqueue(job(2))
    assert writer.stop(5)
    stats = writer.stats()
    assert (stats["writer_failures"], stats["writer_written"]) == (1, 1)


def test_stop_timeout_with_an_enqueue_in_flight_still_drains_everything():
    save = FakeSave(gate_threads=("ssd-writer", "producer"))
    save.gate.clear()
    writer = SSDWriterThread(save, queue_size=1, put_timeout_s=0.01)
    assert writer.enqueue(job(1)) and save.started.wait(5)
    assert writer.enqueue(job(2))
    producer = threading.Thread(target=writer.enqueue, args=(job(3),), name="producer")
    producer.start()  # falls back to a synchronous save and blocks in it: in flight
    deadline = time.monotonic() + 5
    while len(save.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not writer.stop(0.1)  # gave up waiting for the in-flight enqueue
    assert not writer.enqueue(job(4))  # closing
    save.gate.set()
    producer.join(5)
    writer._thread.join(5)  # the last in-flight enqueue queued the sentinel
    assert not writer.is_alive
    assert sorted(save.hashes()) == sorted(job(i).block_hash for i in (1, 2, 3))
    assert writer.stop(1)  # a second stop is harmless
    assert writer.stats()["writer_dropped_after_close"] == 1


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="durability"):
        SSDWriterThread(FakeSave(), durability="fsync")
    with pytest.raises(ValueError, match="queue_size"):
        SSDWriterThread(FakeSave(), queue_size=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux-only")
def test_writer_thread_runs_at_lower_priority_than_requests():
    import os
    import threading as th

    from mlx_kvserve.kv.ssd.writer import WRITER_NICENESS

    seen = []

    def save(block_hash, parent_hash, token_ids, arrays):
        seen.append(os.getpriority(os.PRIO_PROCESS, th.get_native_id()))
        return SaveResult.SAVED

    base = os.getpriority(os.PRIO_PROCESS, 0)
    writer = SSDWriterThread(save)
    writer.enqueue(WriteJob(b"\x01" * 32, b"\x02" * 32, [1], {}))
    writer.stop(5)
    assert seen == [max(base, WRITER_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the rest of the process is untouched


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_hold_pauses_writes_until_resume():
    save = FakeSave()
    writer = SSDWriterThread(save)
    writer.hold(30)
    assert writer.enqueue(job(1)) and writer.enqueue(job(2))
    time.sleep(0.3)
    assert save.hashes() == []  # accepted, not written while held
    assert writer.stats()["writer_queue_depth"] + writer.stats()["writer_pending"] >= 2
    writer.resume()
    assert wait_for(lambda: len(save.hashes()) == 2, 2.0)
    assert writer.stats()["writer_held"] == 1
    assert writer.stop(5)


def test_hold_ends_by_itself_after_max_s():
    save = FakeSave()
    writer = SSDWriterThread(save)
    start = time.monotonic()
    writer.hold(0.4)
    assert writer.enqueue(job(1))
    assert wait_for(lambda: save.hashes() == [job(1).block_hash], 5.0)
    assert time.monotonic() - start >= 0.35
    assert writer.stop(5)


def test_stop_drains_a_held_writer_at_once_and_ignores_later_holds():
    save = FakeSave()
    writer = SSDWriterThread(save)
    writer.hold(60)
    for i in range(5):
        assert writer.enqueue(job(i))
    start = time.monotonic()
    assert writer.stop(5)
    assert time.monotonic() - start < 2
    assert sorted(save.hashes()) == sorted(job(i).block_hash for i in range(5))
    writer.hold(60)  # after stop: no effect, no error
    writer.resume()


def test_upkeep_runs_while_idle():
    """An idle writer still runs its upkeep hook (index flushes, TTL pruning) now and then."""
    calls = []
    writer = SSDWriterThread(FakeSave(), after_job=lambda: calls.append(time.monotonic()), idle_upkeep_s=0.05)
    assert wait_for(lambda: len(calls) >= 3, 5.0)  # no job was ever enqueued
    assert writer.stop(5)


def test_a_hold_that_begins_during_a_batch_of_single_saves_pauses_before_the_next():
    saved: list[bytes] = []
    saving, go = threading.Event(), threading.Event()

    def save(block_hash, parent_hash, token_ids, arrays):
        if not saved:
            saving.set()
            assert go.wait(10)
        saved.append(block_hash)
        return SaveResult.SAVED

    writer = SSDWriterThread(save)
    writer.hold(30)
    for i in range(4):
        assert writer.enqueue(job(i))
    writer.resume()  # one batch of 4, saved one by one
    assert saving.wait(5)
    writer.hold(30)  # a request begins prefilling during the batch
    go.set()
    time.sleep(0.3)
    assert saved == [job(0).block_hash]
    writer.resume()
    assert wait_for(lambda: len(saved) == 4, 5.0)
    assert writer.stop(5)
