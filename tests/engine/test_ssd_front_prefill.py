"""Issue 14 item 3: on an SSD hit, the first blocks are prefilled while the rest are read. Through
the real Engine on the tiny model, after a restart: greedy output equals the cold run's for every
split point, the computed blocks join RAM like read ones, damage in the read part only shortens
the hit, and the split follows the measured speeds."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
from kvharness import greedy

from mlx_kvserve.config import load_config
from mlx_kvserve.engine.cache.front_prefill import SPEEDS_FILE, FrontPrefill
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.kv.ssd.format import block_relpath

BS = 16
NUM_BLOCKS = 6
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))


def _engine(tiny, root, **ssd) -> Engine:
    config = load_config(
        overrides={
            "cache": {"block_size": BS},
            "ssd": {"cache_dir": str(root), **ssd},
            "generation": {"prefill_step_size": 24},  # chunks that do not line up with blocks
        }
    )
    return Engine(tiny, config)


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory):
    """A cache folder holding one prompt's blocks (and tail), and the prompt's cold output."""
    root = tmp_path_factory.mktemp("kv")
    text = " ".join(f"Step {i}: move disk {i % 3} from peg {i % 2} to peg {(i + 1) % 3}." for i in range(40))
    prompt = tiny.tokenizer.encode(text)[: NUM_BLOCKS * BS + 5]
    engine = _engine(tiny, root)
    cold = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert cold[2] == 0
    engine.stop()
    return root, prompt, cold[0]


def _restarted(tiny, root, share: float | None) -> Engine:
    engine = _engine(tiny, root)
    assert engine.local_cache_stats()["kv_ram_blocks"] == 0
    engine.prefix_cache.front.forced_share = share
    return engine


@pytest.mark.parametrize("computed", range(NUM_BLOCKS + 1))
def test_every_split_point_gives_the_cold_output(tiny, stored, computed):
    root, prompt, cold = stored
    engine = _restarted(tiny, root, (computed + 0.5) / NUM_BLOCKS if computed < NUM_BLOCKS else 1.0)
    ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert ids == cold
    assert cached == len(prompt) - 1  # every block (computed or read) and the tail
    stats = engine.local_cache_stats()
    split = 0 < computed < NUM_BLOCKS  # all or nothing computed is a plain read
    assert stats["kv_split_loads"] == int(split)
    assert stats["kv_split_computed_blocks"] == (computed if split else 0)
    assert stats["ssd_hits"] == stats["kv_promotions"] == NUM_BLOCKS - (computed if split else 0)  # read ones
    manager = engine.prefix_cache.manager
    assert all(manager.in_ram(h) for h in manager.hasher.hash_blocks(prompt))  # the computed ones too
    manager.check_integrity()
    again = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert again[0] == cold and engine.local_cache_stats()["ssd_hits"] == stats["ssd_hits"]  # all from RAM
    engine.stop()


def test_damage_in_the_read_part_only_shortens_the_hit(tiny, stored, tmp_path):
    root, prompt, cold = stored
    copy = tmp_path / "kv"
    shutil.copytree(root, copy)
    victim = 4  # blocks 0-1 computed, 2-3 read, 4 damaged, 5 unreachable
    engine = _restarted(tiny, copy, 2.5 / NUM_BLOCKS)
    hashes = engine.prefix_cache.manager.hasher.hash_blocks(prompt)
    engine.stop()
    path = next(copy.rglob(Path(block_relpath(hashes[victim])).name))
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x55
    path.write_bytes(bytes(data))
    engine = _restarted(tiny, copy, 2.5 / NUM_BLOCKS)
    ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert ids == cold and cached == victim * BS
    stats = engine.local_cache_stats()
    assert stats["kv_split_computed_blocks"] == 2 and stats["ssd_hits"] == 2 and stats["ssd_corrupt"] == 1
    engine.stop()


def test_the_split_follows_the_measured_speeds():
    speeds = {"read": None, "prefill": None}
    front = FrontPrefill(None, None, BS, 512, lambda: speeds["read"], lambda: speeds["prefill"])
    assert front.blocks_to_compute(0, 100) == 0  # nothing measured yet: read everything
    speeds.update(read=100.0, prefill=1600.0)  # a block: 10 ms to read, 10 ms to compute
    assert front.blocks_to_compute(0, 100) == 50
    speeds.update(read=900.0)  # reading is 9x faster: compute a tenth
    assert front.blocks_to_compute(3, 100) == 10
    speeds.update(read=10.0)  # a slow disk: compute most of it
    assert front.blocks_to_compute(0, 100) == 90
    front.forced_share = 0.25
    assert front.blocks_to_compute(0, 8) == 2


def test_it_is_off_for_models_with_checkpoints_and_by_configuration(tiny, tmp_path):
    engine = _engine(tiny, tmp_path / "kv", compute_while_loading=False)
    assert engine.prefix_cache.front is None
    engine.stop()


def test_the_first_hit_after_a_restart_splits_by_the_last_runs_speeds(tiny, stored, tmp_path):
    root, prompt, cold = stored
    copy = tmp_path / "kv"
    shutil.copytree(root, copy)
    engine = _engine(tiny, copy)
    greedy(engine.scheduler, list(reversed(prompt)), 2)  # measures a prefill
    engine.prefix_cache.ssd_tier.block_reads.add(100, 1.0)  # as if 100 blocks were read in 1 s
    read, prefill = engine.prefix_cache.front.speeds()
    engine.stop()
    saved = json.loads(next(copy.rglob(SPEEDS_FILE)).read_text())
    assert saved == {"blocks_read_per_s": read, "prefill_tokens_per_s": prefill} and read == 100.0 and prefill > 0

    engine = _engine(tiny, copy)  # nothing measured in this run yet: the last run's speeds decide
    front = engine.prefix_cache.front
    assert front.speeds() == (read, prefill)
    expected = front.blocks_to_compute(0, NUM_BLOCKS)
    ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert ids == cold and cached == len(prompt) - 1
    stats = engine.local_cache_stats()
    assert stats["kv_split_computed_blocks"] == (expected if 0 < expected < NUM_BLOCKS else 0)
    engine.stop()


def test_a_damaged_speeds_file_is_set_aside(tiny, tmp_path):
    root = tmp_path / "kv"
    engine = _engine(tiny, root)
    folder = engine.prefix_cache.ssd_tier.store.cache_dir
    engine.stop()
    (folder / SPEEDS_FILE).write_text('{"blocks_read_per_s": "fast"}')
    engine = _engine(tiny, root)
    assert engine.prefix_cache.front.speeds() == (None, None)
    assert not (folder / SPEEDS_FILE).exists()
    engine.stop()


def _submit_all(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple]:
    """Submit every prompt to the worker at once; (token ids, cached tokens) of each, in order."""
    results: dict[int, list] = {i: [] for i in range(len(prompts))}
    done = [threading.Event() for _ in prompts]
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0)
        engine.submit(GenerationRequest(f"r{i}", list(prompt), params, results[i].append, on_done=done[i].set))
    assert all(d.wait(120) for d in done)
    out = []
    for i in range(len(prompts)):
        finished = results[i][-1]
        assert isinstance(finished, Finished), results[i]
        out.append((finished.token_ids, finished.usage.cached_tokens))
    return out


@pytest.mark.parametrize("share", [None, 0.4])  # every block read; the first ones computed
def test_ssd_hits_load_while_other_requests_run(tiny, stored, tmp_path, share):
    root, prompt, cold = stored
    copy = tmp_path / "kv"
    shutil.copytree(root, copy)
    other, shorter = list(reversed(prompt)), prompt[: 4 * BS + 3]  # a cold request; a shorter hit
    solo = _engine(tiny, tmp_path / "solo")  # the references, before any worker thread runs
    other_alone = greedy(solo.scheduler, other, 24)[0]
    shorter_alone = greedy(solo.scheduler, shorter, MAX_TOKENS)[0]
    solo.stop()
    engine = _restarted(tiny, copy, share)
    engine.start()
    got = _submit_all(engine, [other, prompt, shorter], [24, MAX_TOKENS, MAX_TOKENS])
    engine.stop()
    assert got[0] == (other_alone, 0)
    assert got[1] == (cold, len(prompt) - 1)
    assert got[2][0] == shorter_alone and got[2][1] >= 4 * BS
    assert engine.local_cache_stats()["kv_split_loads"] == (0 if share is None else 1)
    engine.prefix_cache.manager.check_integrity()


class SlowDisk:
    """A block-read meter that reads as one block per second once anything was measured."""

    def __init__(self):
        self.samples = 0

    def add(self, blocks: int, seconds: float) -> None:
        self.samples += 1

    def bytes_per_s(self) -> float | None:
        return 1.0 if self.samples else None


def test_without_a_measured_read_one_block_is_read_first_and_the_rest_split(tiny, stored, tmp_path):
    root, prompt, cold = stored
    copy = tmp_path / "kv"
    shutil.copytree(root, copy)
    engine = _restarted(tiny, copy, None)
    front = engine.prefix_cache.front
    meter = SlowDisk()
    engine.prefix_cache.ssd_tier.block_reads = meter
    front.blocks_read_per_s = meter.bytes_per_s
    greedy(engine.scheduler, list(reversed(prompt)), 2)  # this run measures a prefill, no read yet
    assert front.wants_a_read_sample()
    ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert ids == cold and cached == len(prompt) - 1
    expected = front.blocks_to_compute(1, NUM_BLOCKS - 1)  # the rest, split by the sampled speed
    assert 0 < expected < NUM_BLOCKS - 1
    stats = engine.local_cache_stats()
    assert meter.samples == 1 and stats["kv_split_computed_blocks"] == expected
    assert stats["ssd_hits"] == 1 + (NUM_BLOCKS - 1 - expected)
    engine.stop()


def test_a_failed_front_compute_is_a_miss_and_holds_nothing(tiny, stored, tmp_path, monkeypatch):
    root, prompt, cold = stored
    copy = tmp_path / "kv"
    shutil.copytree(root, copy)
    engine = _restarted(tiny, copy, 0.5)

    def fail(*_):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.prefix_cache.front, "compute", fail)
    ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert ids == cold and cached < BS  # prefilled instead (at most a tail under the namespace is reused)
    stats = engine.local_cache_stats()
    assert stats["kv_in_use_blocks"] == 0 and stats["kv_split_loads"] == 0
    engine.prefix_cache.manager.check_integrity()
    engine.stop()


def _longer_after_restart(tiny, stored, tmp_path) -> tuple[Engine, list[int], tuple[int, ...]]:
    """A restarted engine on a copy of the stored folder, a prompt longer than the stored one (its
    blocks on the SSD, then new ones), and that prompt's output from an engine of its own."""
    root, prompt, _ = stored
    copy = tmp_path / "kv"
    shutil.copytree(root, copy)
    longer = prompt + list(reversed(prompt))[: 3 * BS]
    solo = _engine(tiny, tmp_path / "solo")
    alone = greedy(solo.scheduler, longer, MAX_TOKENS)[0]
    solo.stop()
    return _restarted(tiny, copy, None), longer, alone


def test_a_request_beside_a_restore_gets_its_blocks_from_ram(tiny, stored, tmp_path):
    """Two requests for one longer prompt after a restart: the first reads the stored blocks into its
    own cache and prefills the rest; once its prompt is registered (the blocks it read with it, since
    another request is about: scheduler.py `_register_prompt`), the second hits RAM for all of it."""
    engine, longer, alone = _longer_after_restart(tiny, stored, tmp_path)
    engine.start()
    got = _submit_all(engine, [longer, longer], [MAX_TOKENS, MAX_TOKENS])
    stats = engine.local_cache_stats() | engine.batch_stats()
    engine.stop()
    assert got[0][0] == got[1][0] == alone
    assert got[0][1] == NUM_BLOCKS * BS + 5 and got[1][1] == len(longer) - 1
    assert stats["ssd_hits"] == stats["kv_promotions"] == NUM_BLOCKS  # read once
    engine.prefix_cache.manager.check_integrity()


def test_a_request_after_a_restore_s_prompt_gets_its_blocks_from_ram(tiny, stored, tmp_path):
    """A request alone on a restore keeps the blocks it read in its own cache while it decodes (they
    would join RAM when it ends, without a copy); a second request for the same prompt arriving
    meanwhile has them put into RAM first, so it hits RAM for all of it, the first's new blocks too."""
    engine, longer, alone = _longer_after_restart(tiny, stored, tmp_path)
    scheduler, manager = engine.scheduler, engine.prefix_cache.manager
    events: dict[int, list] = {0: [], 1: []}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    first = GenerationRequest("r0", list(longer), params, events[0].append)
    scheduler.admit(first)
    while not any(r.prompt_registered for r in scheduler._running.values()):
        scheduler.step()
    assert scheduler.is_running(first) and not manager.in_ram(manager.hasher.hash_blocks(longer, 1)[0])
    second = GenerationRequest("r1", list(longer), params, events[1].append)
    scheduler.admit(second)
    while scheduler.is_running(first) or scheduler.is_running(second):
        scheduler.step()
    done = [events[i][-1] for i in (0, 1)]
    assert [d.token_ids for d in done] == [alone, alone]
    assert [d.usage.cached_tokens for d in done] == [NUM_BLOCKS * BS + 5, len(longer) - 1]
    stats = engine.local_cache_stats()
    assert stats["ssd_hits"] == stats["kv_promotions"] == NUM_BLOCKS  # read once
    manager.check_integrity()
    engine.stop()
