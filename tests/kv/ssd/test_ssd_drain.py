"""The shutdown drain of the SSD writer, on a fake disk of known speed: it waits what the queued bytes
take at the measured write speed (with a margin), never more than its ceiling (`ssd.drain_timeout_s`);
what is still queued then is dropped and logged, and nothing is written after `stop` returns."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from mlx_kvserve.kv.ssd import writer as writer_module
from mlx_kvserve.kv.ssd.store import SaveResult
from mlx_kvserve.kv.ssd.writer import DRAIN_MARGIN, MIB, DrainEstimate, SSDWriterThread, WriteJob

JOB_BYTES = 2 * MIB


def job(i: int, depth: int) -> WriteJob:
    return WriteJob(i.to_bytes(32, "big"), b"\0" * 32, (i,), {"a": np.zeros(JOB_BYTES, np.uint8)}, depth)


class FakeDisk:
    """save_batch writing at `bytes_per_s` (a sleep per job); records what it wrote and when."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self.lock = threading.Lock()
        self.written: list[tuple[bytes, float]] = []

    def __call__(self, jobs: list[WriteJob]) -> list[SaveResult]:
        for j in jobs:
            time.sleep(JOB_BYTES / self.bytes_per_s)
            with self.lock:
                self.written.append((j.block_hash, time.monotonic()))
        return [SaveResult.SAVED] * len(jobs)

    def hashes(self) -> list[bytes]:
        with self.lock:
            return [h for h, _ in self.written]


@pytest.fixture(autouse=True)
def short_slack(monkeypatch):
    monkeypatch.setattr(writer_module, "DRAIN_SLACK_S", 0.2)  # seconds, not the product's 2 s


def _queued(disk: FakeDisk, num_jobs: int) -> SSDWriterThread:
    """A writer whose speed was measured on 4 jobs, holding `num_jobs` more (depth = their order)."""
    writer = SSDWriterThread(save_batch=disk, max_batch_jobs=2)
    for i in range(4):
        writer.enqueue(job(1000 + i, 0))
    assert writer.wait_idle(10) == 0
    writer.hold(60)
    for i in range(num_jobs):
        assert writer.enqueue(job(i, depth=i))
    return writer


def test_the_limit_is_the_time_the_queued_bytes_take_at_the_measured_speed_within_the_ceiling():
    est = DrainEstimate(150, 300 * MIB, 100 * MIB, 300 / 100 * DRAIN_MARGIN + 2.0)
    assert est.limit_s(120.0) == pytest.approx(6.5)  # what the bytes ask for
    assert est.limit_s(5.0) == 5.0  # never more than the ceiling
    assert est.limit_s(0.0) == 0.0


def test_a_clean_stop_writes_everything_queued_in_about_the_time_its_bytes_take(caplog):
    disk = FakeDisk(200 * MIB)
    writer = _queued(disk, 20)
    est = writer.drain_estimate()
    assert est.nbytes == 20 * JOB_BYTES
    assert 100 * MIB < est.bytes_per_s <= 200 * MIB  # measured (the fake's sleeps run a little long)
    assert est.asked_s == pytest.approx(est.nbytes / est.bytes_per_s * DRAIN_MARGIN + 0.2)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.kv.ssd.writer"):
        assert writer.stop(drain_timeout=60.0)
    assert time.monotonic() - start < est.asked_s  # what the bytes took, not the ceiling
    assert disk.hashes()[4:] == [job(i, i).block_hash for i in range(20)]
    assert f"limit {est.asked_s:.1f} s, ceiling 60.0 s" in caplog.text
    assert writer.stats()["writer_dropped_at_stop"] == 0


def test_a_disk_stalled_after_its_measurement_is_given_up_on_at_the_limit_and_the_log_says_what_was_dropped(caplog):
    disk = FakeDisk(200 * MIB)
    writer = _queued(disk, 20)
    est = writer.drain_estimate()
    disk.bytes_per_s = 20 * MIB  # ten times slower than measured: 20 jobs would take 2 s
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.kv.ssd.writer"):
        assert not writer.stop(drain_timeout=60.0)
    stopped = time.monotonic()
    assert stopped - start < est.asked_s + 1.0  # the limit and one batch (2 jobs), never the 60 s ceiling
    assert not writer.is_alive and all(t <= stopped for _, t in disk.written)  # nothing written afterwards
    written = disk.hashes()[4:]
    assert 1 <= len(written) < 20
    assert written == [job(i, i).block_hash for i in range(len(written))]  # the shallowest first
    dropped = 20 - len(written)
    stats = writer.stats()
    assert (stats["writer_dropped_at_stop"], stats["writer_dropped_at_stop_bytes"]) == (dropped, dropped * JOB_BYTES)
    assert stats["writer_pending"] == 0 and stats["writer_queue_depth"] == 0
    assert (
        f"{dropped} queued blocks and tails ({dropped * JOB_BYTES / MIB:.1f} MiB) not written "
        f"(0 pinned; chain depths {len(written)}-19)" in caplog.text
    )


def test_a_ceiling_of_zero_drains_nothing_and_reports_every_queued_job():
    disk = FakeDisk(200 * MIB)
    writer = _queued(disk, 6)
    assert not writer.stop(drain_timeout=0.0)
    assert len(disk.hashes()) - 4 + writer.stats()["writer_dropped_at_stop"] == 6
    assert writer.stats()["writer_dropped_at_stop"] >= 4  # at most one batch was already taken
