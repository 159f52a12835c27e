"""The bounded block event log the router follows: ordering, resumption and resync."""

import threading

import pytest

from mlx_kvserve.kv.events import BlockEventKind, BlockEventLog


def test_since_resumes_after_last_seen():
    log = BlockEventLog(capacity=10)
    log.stored(b"a")
    log.stored(b"b")
    log.removed(b"a")
    got = log.since(1)
    assert [(e.seq, e.kind, e.block_hash) for e in got.events] == [
        (2, BlockEventKind.STORED, b"b"),
        (3, BlockEventKind.REMOVED, b"a"),
    ]
    assert (got.last_seq, got.resync) == (3, False)
    assert log.since(3).events == [] and not log.since(3).resync


def test_empty_log_from_zero_is_not_a_resync():
    got = BlockEventLog().since(0)
    assert (got.events, got.last_seq, got.resync) == ([], 0, False)


def test_too_old_since_asks_for_resync():
    log = BlockEventLog(capacity=3)
    for h in (b"1", b"2", b"3", b"4", b"5"):
        log.stored(h)
    assert log.since(1).resync  # events 2 was dropped
    got = log.since(2)  # 3, 4, 5 are all still there
    assert [e.seq for e in got.events] == [3, 4, 5] and not got.resync


def test_future_since_asks_for_resync():
    # a follower that saw a previous process's numbers
    log = BlockEventLog()
    log.stored(b"x")
    assert log.since(7).resync


def test_limit_pages_through():
    log = BlockEventLog()
    for i in range(5):
        log.stored(bytes([i]))
    first = log.since(0, limit=2)
    assert [e.seq for e in first.events] == [1, 2]
    assert [e.seq for e in log.since(first.events[-1].seq, limit=10).events] == [3, 4, 5]


def test_concurrent_appends_keep_unique_ordered_seqs():
    log = BlockEventLog(capacity=10_000)
    threads = [threading.Thread(target=lambda: [log.stored(b"h") for _ in range(500)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [e.seq for e in log.since(0).events]
    assert seqs == list(range(1, 2001))


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        BlockEventLog(capacity=0)
