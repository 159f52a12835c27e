"""Issue 14 items 4-5 through the real Engine on the tiny model: a shutdown drain given the time it
asks for writes everything queued (clean shutdown, full hit after restart), and [ssd]
prefetch_on_start reads the hottest chains into RAM while a request right after startup is served
exactly as cold."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import pytest
from kvharness import greedy

from mlx_kvserve.config import load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

BS = 16
MAX_TOKENS = 6


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _config(cache_dir: Path, **ssd):
    return load_config(overrides={"cache": {"block_size": BS}, "ssd": {"cache_dir": str(cache_dir), **ssd}})


def _prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts of 4 blocks and a tail, each with its own first block."""
    out = []
    for p in range(n):
        text = " ".join(f"Topic {p}, entry {i}: lamp {i} of tower {p} shines at {i * 3 + p}." for i in range(16))
        out.append(tokenizer.encode(text)[: 4 * BS + BS // 2])
    return out


def _submit(engine: Engine, prompt: list[int]) -> tuple[tuple[int, ...], int]:
    """(token ids, cached tokens) of a greedy request through the worker thread."""
    events: list = []
    done = threading.Event()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    engine.submit(GenerationRequest("warm", list(prompt), params, events.append, on_done=done.set))
    assert done.wait(120)
    finished = events[-1]
    assert isinstance(finished, Finished), events
    return finished.token_ids, finished.usage.cached_tokens


def test_a_drain_given_the_time_it_asks_for_writes_everything(tiny, tmp_path, caplog):
    root = tmp_path / "kv"
    prompts = _prompts(tiny.tokenizer, 3)
    engine = Engine(tiny, _config(root, write_hold_s=0.0))
    tier = engine.prefix_cache.ssd_tier
    cold = [greedy(engine.scheduler, p, MAX_TOKENS)[0] for p in prompts[:1]]
    assert tier.writer.wait_idle(30) == 0 and tier.writer.bandwidth.bytes_per_s()  # one measured batch
    tier.writer.hold(120)  # the disk "falls behind": everything after this is still queued at shutdown
    tier.hold_writes = tier.resume_writes = lambda: None  # requests' prefills must not lift the hold
    cold += [greedy(engine.scheduler, p, MAX_TOKENS)[0] for p in prompts[1:]]
    estimate = tier.writer.drain_estimate()
    assert estimate.num_jobs >= 2 * 4  # the last two prompts' blocks (and tails)
    engine.config = dataclasses.replace(
        engine.config, ssd=dataclasses.replace(engine.config.ssd, drain_timeout_s=estimate.asked_s)
    )
    with caplog.at_level(logging.INFO, logger="mlx_kvserve.kv.ssd.writer"):
        engine.stop()
    assert f"draining {estimate.num_jobs} blocks" in caplog.text

    again = Engine(tiny, _config(root))
    assert again.prefix_cache.ssd_tier.last_shutdown["shutdown_clean"] is True
    for prompt, ids in zip(prompts, cold, strict=True):
        hit_ids, _, cached = greedy(again.scheduler, prompt, MAX_TOKENS)
        assert cached == len(prompt) - 1 and hit_ids == ids  # every block and tail came back
    assert again.local_cache_stats()["ssd_hits"] == 3 * 4
    again.stop()


def _fill(tiny, root: Path, prompts: list[list[int]], pin: int | None = None) -> tuple[list, int]:
    """Run each prompt once (cold) into a cache at `root`, pin one prompt's chain, stop cleanly.
    Returns the cold outputs and the bytes of one block."""
    engine = Engine(tiny, _config(root))
    cold = []
    for prompt in prompts:
        cold.append(greedy(engine.scheduler, prompt, MAX_TOKENS)[0])
        time.sleep(0.01)  # distinct access times on the SSD
    manager = engine.prefix_cache.manager
    if pin is not None:
        manager.pins.pin(manager.hasher.hash_blocks(prompts[pin]))
    ram = manager.stats()
    engine.stop()
    return cold, ram["kv_ram_bytes"] // ram["kv_ram_blocks"]


def _wait_prefetched(engine: Engine) -> dict:
    deadline = time.monotonic() + 60
    while not engine.prefetcher.ended and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.prefetcher.ended
    return engine.local_cache_stats()


def test_prefetch_on_start_warms_ram_and_the_first_request_is_served_as_cold(tiny, tmp_path):
    root = tmp_path / "kv"
    prompts = _prompts(tiny.tokenizer, 3)
    cold, _ = _fill(tiny, root, prompts)
    engine = Engine(tiny, _config(root, prefetch_on_start=True))
    engine.start()
    ids, cached = _submit(engine, prompts[1])  # right after startup, while the prefetch runs
    assert ids == cold[1] and cached == len(prompts[1]) - 1
    stats = _wait_prefetched(engine)
    manager = engine.prefix_cache.manager
    stored = [h for p in prompts for h in manager.hasher.hash_blocks(p)]
    assert all(manager.in_ram(h) for h in stored)
    assert stats["kv_ram_blocks"] == len(stored) == 3 * 4
    assert stats["ssd_prefetch_blocks"] + stats["kv_promotions"] == len(stored)  # each read from the SSD once
    assert stats["ssd_prefetch_done"] is True
    hits_before = stats["ssd_hits"]
    for prompt, expected in zip(prompts, cold, strict=True):
        assert _submit(engine, prompt) == (expected, len(prompt) - 1)
    assert engine.local_cache_stats()["ssd_hits"] == hits_before  # every block came from RAM
    manager.check_integrity()
    engine.stop()


def test_prefetch_reads_pinned_chains_first_and_stays_within_its_limit(tiny, tmp_path):
    root = tmp_path / "kv"
    prompts = _prompts(tiny.tokenizer, 3)
    _, block_bytes = _fill(tiny, root, prompts, pin=0)  # the pinned prompt is the least recently used
    limit = 4 * block_bytes + block_bytes // 2  # its chain fits, one more block would not
    engine = Engine(tiny, _config(root, prefetch_on_start=True, prefetch_max_bytes=limit))
    engine.start()
    stats = _wait_prefetched(engine)
    manager = engine.prefix_cache.manager
    assert [manager.in_ram(h) for h in manager.hasher.hash_blocks(prompts[0])] == [True] * 4
    assert stats["kv_ram_blocks"] == stats["ssd_prefetch_blocks"] == 4
    assert stats["ssd_prefetch_bytes"] <= limit
    assert "limit" in engine.prefetcher.ended
    engine.stop()


def test_prefetch_is_off_by_default(tiny, tmp_path):
    root = tmp_path / "kv"
    _fill(tiny, root, _prompts(tiny.tokenizer, 1))
    engine = Engine(tiny, _config(root))
    engine.start()
    time.sleep(0.3)
    stats = engine.local_cache_stats()
    assert engine.prefetcher is None and stats["kv_ram_blocks"] == 0 and "ssd_prefetch_blocks" not in stats
    engine.stop()
