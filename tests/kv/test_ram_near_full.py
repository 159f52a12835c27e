"""A prefix about the size of the RAM tier (issue 44's realistic 32k row: the exact repeat of a 4 GiB
prompt got 0 cached tokens while the new question right after hit the whole prefix).

Registering a long prompt's blocks in chain order made its first block the least recently used of
them, so the RAM tier, full, evicted the head of the chain while keeping its deeper blocks: useless
without it (a lookup walks from the first block). RAM now gives up a chain from its deep end."""

from __future__ import annotations

import numpy as np
import pytest
from kvharness import greedy

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.config import load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.kv.base import Block, NewBlock
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore

BS = 16
PREFIX_BLOCKS = 24
QUESTION = 8


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))


def _engine(tiny, ram_max_bytes: int = 0) -> Engine:
    cache = {"block_size": BS, **({"ram_max_bytes": ram_max_bytes} if ram_max_bytes else {})}
    return Engine(tiny, load_config(overrides={"cache": cache, "ssd": {"enabled": False}}))


def test_an_exact_repeat_of_a_prefix_near_the_ram_size_hits_at_least_what_a_new_question_hits(tiny):
    rng = np.random.default_rng(7)
    ids = lambda n: rng.integers(3, 200, size=n).tolist()  # noqa: E731
    prefix, questions = ids(PREFIX_BLOCKS * BS), [ids(QUESTION) for _ in range(2)]
    probe = _engine(tiny)
    cold, _, _ = greedy(probe.scheduler, prefix + questions[0], 4)
    stats = probe.local_cache_stats()
    block_bytes = stats["kv_ram_bytes"] // stats["kv_ram_blocks"]
    probe.stop()

    # As the bench's --ram-max-bytes 4608MiB for a 4 GiB prefix: the budget is just above the prefix,
    # and the blocks' share of it (tails take an eighth) just below.
    engine = _engine(tiny, int(PREFIX_BLOCKS * block_bytes * 1.06))
    capacity = engine.prefix_cache.manager.stats()["kv_ram_max_bytes"] // block_bytes
    assert capacity < PREFIX_BLOCKS  # the prefix does not fit whole
    first, _, cached = greedy(engine.scheduler, prefix + questions[0], 4)
    assert cached == 0 and first == cold
    repeat, _, repeat_cached = greedy(engine.scheduler, prefix + questions[0], 4)
    assert repeat == cold  # the hit's output is the cold output
    assert repeat_cached == capacity * BS  # the chain's head kept: its deep end was given up
    _, _, new_cached = greedy(engine.scheduler, prefix + questions[1], 4)
    assert repeat_cached >= new_cached > 0
    engine.prefix_cache.manager.check_integrity()
    engine.stop()


# --- the same on fake payloads: which blocks RAM gives up -------------------------------------------

UNIT = 100  # bytes of one fake block


def _manager(num_blocks: int) -> KVManager:
    return KVManager(BlockHasher(namespace_hash("m", "float32", BS), BS), RAMStore(num_blocks * UNIT))


def _register(mgr: KVManager, tokens: list[int]) -> None:
    """What the engine does after a prefill: every new full block of `tokens` at once, with its chain."""
    hashes = mgr.hasher.hash_blocks(tokens, len(tokens) // BS)
    new = [
        NewBlock(h, parent, tuple(tokens[i * BS : (i + 1) * BS]), f"payload-{i}", UNIT, i)
        for i, h, parent in mgr.new_blocks(tokens, 0, len(hashes), hashes)
    ]
    mgr.cache_blocks(new, hashes)


def _cached(mgr: KVManager, tokens: list[int]) -> int:
    match = mgr.lookup(tokens)
    mgr.release(match.blocks)
    return match.num_tokens


def test_registering_a_chain_longer_than_ram_keeps_its_head():
    mgr = _manager(6)
    long = list(range(8 * BS))
    _register(mgr, long)
    assert _cached(mgr, long + [0]) == 6 * BS  # blocks 0-5 kept, 6-7 given up (before: 0-1 evicted, a miss)
    mgr.check_integrity()


def test_after_a_hit_a_newcomer_evicts_the_chains_deep_end_not_its_head():
    mgr = _manager(6)
    first = list(range(6 * BS))
    _register(mgr, first)
    assert _cached(mgr, first + [0]) == 6 * BS  # a hit: every block touched, the root last
    _register(mgr, [9000 + t for t in range(2 * BS)])  # another prompt's two blocks
    assert _cached(mgr, first + [0]) == 4 * BS  # blocks 4-5 went, 0-3 still a hit
    mgr.check_integrity()


def test_a_new_question_registering_after_its_prefix_keeps_the_prefix_head():
    mgr = _manager(6)
    prefix = list(range(5 * BS))
    _register(mgr, prefix)
    assert _cached(mgr, prefix + [0]) == 5 * BS
    _register(mgr, prefix + [7000 + t for t in range(2 * BS)])  # the question's own two blocks: one too many
    assert _cached(mgr, prefix + [0]) == 5 * BS  # the question's last block went, the prefix stays whole
    mgr.check_integrity()


def test_prefetched_blocks_go_in_as_least_recently_used_and_leave_from_the_deep_end():
    mgr = _manager(4)
    used = list(range(2 * BS))
    _register(mgr, used)
    chain = [5000 + t for t in range(2 * BS)]
    hashes = mgr.hasher.hash_blocks(chain, 2)
    for i, h in enumerate(hashes):  # read ahead root first, as the prefetcher does
        parent = hashes[i - 1] if i else mgr.hasher.namespace
        assert mgr.add_prefetched(Block(h, parent, tuple(chain[i * BS : (i + 1) * BS]), f"pre-{i}", UNIT))
    _register(mgr, [8000 + t for t in range(BS)])  # one block over: the prefetched chain's deep end goes
    assert _cached(mgr, chain + [0]) == BS and _cached(mgr, used + [0]) == 2 * BS
    mgr.check_integrity()


def test_a_partial_hit_marks_the_blocks_it_found_used():
    mgr = _manager(4)
    a, b = list(range(2 * BS)), [6000 + t for t in range(2 * BS)]
    _register(mgr, a)
    _register(mgr, b)  # a is now the least recently used
    assert _cached(mgr, a + [1] * BS + [0]) == 2 * BS  # a's two blocks, then a miss (no next tier)
    _register(mgr, [8000 + t for t in range(BS)])  # one block over: b's deep end goes, not a's
    assert _cached(mgr, a + [0]) == 2 * BS and _cached(mgr, b + [0]) == BS
    mgr.check_integrity()
