"""A prefix longer than the SSD writer's queue reaches the SSD whole (issue 44, the 128k restore): the
queue is bounded by bytes, blocks shed from it while RAM still holds them are taken back, root first,
whenever it runs empty, and a clean stop's drain writes RAM blocks the SSD lacks. Fake payloads of a
few bytes on a disk whose fsyncs are no-ops, so 2,048 blocks take a second or two."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.base import NewBlock
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.payloads import KV, LayerSpec, payload_to_arrays
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.kv.ssd import format as ssd_format
from mlx_kvserve.kv.ssd import store as store_module
from mlx_kvserve.kv.ssd import writer as writer_module
from mlx_kvserve.kv.ssd.store import SSDStore
from mlx_kvserve.kv.ssd.tier import SSDTier
from mlx_kvserve.kv.ssd.writer import SSDWriterThread

BS = 4
NS = namespace_hash("m", "float32", BS)
NUM_BLOCKS = 2048  # 128k tokens at 64-token blocks
BLOCK_BYTES = 2 * BS * 2 * 4  # keys and values, (1, 1, BS, 2) float32
QUEUE_BYTES = 64 * BLOCK_BYTES  # room for 64 blocks: the chain is 32 times longer


@pytest.fixture(autouse=True)
def fake_disk(monkeypatch):
    """No fsync: the test is about which blocks are written, not how durably."""
    monkeypatch.setattr(ssd_format, "fsync_path", lambda path: None)
    monkeypatch.setattr(store_module, "fsync_dir", lambda path: None)


def payload(i: int) -> dict[str, mx.array]:
    arrays = {"0.k": mx.full((1, 1, BS, 2), float(i)), "0.v": mx.full((1, 1, BS, 2), -float(i))}
    mx.eval(list(arrays.values()))
    return arrays


def stack(
    tmp_path, policy: str = "write_through", queue_bytes: int = QUEUE_BYTES, s_per_block: float = 0.0
) -> tuple[KVManager, SSDTier]:
    """A manager with room for the whole chain in RAM over an SSD tier wired as engine/build.py does
    (`s_per_block`: a slower disk)."""
    store = SSDStore(tmp_path, NS)
    holder: list[SSDTier] = []

    def save_batch(jobs):
        time.sleep(s_per_block * len(jobs))
        return holder[0].save_jobs(jobs)

    writer = SSDWriterThread(
        save_batch=save_batch,
        queue_size=None,
        queue_bytes=queue_bytes,
        when_full="shed",
        value=lambda j: holder[0].job_value(j),
        on_shed=lambda j: holder[0].forget_job(j),
    )
    tier = SSDTier(store, writer, policy, to_arrays=dict, from_arrays=lambda a: (a, BLOCK_BYTES))
    holder.append(tier)
    writer.attach_backlog(tier)
    manager = KVManager(BlockHasher(NS, BS), RAMStore(10 * NUM_BLOCKS * BLOCK_BYTES), next_tier=tier)
    tier.attach_ram(manager.blocks_in_ram)
    return manager, tier


def prefill(manager: KVManager, tokens: list[int], on_block=None) -> list[bytes]:
    """Register the prompt's blocks one by one, as a prefill does (each handed to the tier at once)."""
    hashes = manager.hasher.hash_blocks(tokens)
    for i, block_hash in enumerate(hashes):
        parent = hashes[i - 1] if i else NS
        ids = tuple(tokens[i * BS : (i + 1) * BS])
        manager.cache_blocks([NewBlock(block_hash, parent, ids, payload(i), BLOCK_BYTES, depth=i)], hashes[: i + 1])
        if on_block is not None:
            on_block()
    return hashes


def wait_written(tier: SSDTier, hashes: list[bytes], timeout_s: float = 60.0) -> int:
    """How many of `hashes` the SSD holds once the writer is idle (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while sum(map(tier.contains, hashes)) < len(hashes) and time.monotonic() < deadline:
        tier.writer.wait_idle(max(0.0, deadline - time.monotonic()))
        time.sleep(0.05)
    return sum(map(tier.contains, hashes))


def restored_tokens(tmp_path, tokens: list[int]) -> int:
    """Tokens a fresh manager over the same folder (a restart: empty RAM) finds for `tokens`."""
    manager, tier = stack(tmp_path)
    try:
        match = manager.lookup(tokens)
        n = len(match.blocks) * BS
        manager.release(match.blocks)
        return n
    finally:
        tier.close(drain_timeout_s=10)


def test_a_chain_32x_longer_than_the_queue_reaches_the_ssd_whole_and_a_restart_restores_all_of_it(tmp_path):
    tokens = list(range(NUM_BLOCKS * BS))
    manager, tier = stack(tmp_path)
    tier.writer.hold(60)  # as during a request's prefill: the disk falls behind
    peak = [0]

    def track():
        peak[0] = max(peak[0], tier.writer.stats()["writer_queued_bytes"])

    hashes = prefill(manager, tokens, track)
    stats = tier.writer.stats()
    assert stats["writer_shed"] >= NUM_BLOCKS - 64  # the disk "could not keep up": most were shed
    assert peak[0] <= QUEUE_BYTES  # the queue's memory stays within its byte bound
    tier.writer.resume()
    assert wait_written(tier, hashes) == NUM_BLOCKS  # the shed ones were taken back from RAM
    assert tier.writer.stats()["writer_refilled"] >= NUM_BLOCKS - 64
    assert tier.writer.wait_idle(5) == 0
    assert tier.close(drain_timeout_s=30)
    assert restored_tokens(tmp_path, tokens) == NUM_BLOCKS * BS


def test_blocks_taken_back_go_root_first(tmp_path):
    manager, tier = stack(tmp_path)
    tier.writer.hold(60)
    hashes = prefill(manager, list(range(512 * BS)))
    assert tier.writer.stats()["writer_shed"] == 512 - 64  # the queue kept the shallowest 64
    taken = tier.take_backlog(10 * BLOCK_BYTES)
    assert [j.depth for j in taken] == list(range(64, 74))  # the shed ones from the root side
    assert [j.block_hash for j in taken] == hashes[64:74]
    for j in taken:  # as the writer would have queued them
        tier.forget_job(j)
    tier.writer.resume()
    assert wait_written(tier, hashes) == 512
    assert tier.close(drain_timeout_s=30)


def test_a_clean_stop_writes_the_ram_blocks_an_evict_only_ssd_lacks_root_first(tmp_path, monkeypatch):
    # Nothing written before the stop, so the drain assumes a speed: 64-byte files cost per file, not per byte.
    monkeypatch.setattr(writer_module, "ASSUMED_BYTES_PER_S", 16 * 1024)
    tokens = list(range(NUM_BLOCKS * BS))
    manager, tier = stack(tmp_path, policy="evict_only")
    hashes = prefill(manager, tokens)
    assert not any(map(tier.contains, hashes))  # evict_only: nothing written while RAM holds them
    # engine.stop: persist_resident, then the drain (formerly 512 queued, the rest shed)
    assert tier.persist_resident(manager.resident_blocks()) == NUM_BLOCKS
    assert tier.writer.drain_estimate().nbytes >= NUM_BLOCKS * BLOCK_BYTES  # the drain is sized for them
    assert tier.close(drain_timeout_s=60)
    assert sum(map(tier.contains, hashes)) == NUM_BLOCKS
    assert restored_tokens(tmp_path, tokens) == NUM_BLOCKS * BS


def test_a_drain_cut_at_its_limit_leaves_a_prefix_on_the_ssd(tmp_path):
    """The drain writes the RAM blocks root first: what its limit leaves out is the chain's deep end."""
    manager, tier = stack(tmp_path, policy="evict_only", s_per_block=0.002)
    hashes = prefill(manager, list(range(NUM_BLOCKS * BS)))
    tier.persist_resident(manager.resident_blocks())
    assert not tier.close(drain_timeout_s=0.5)  # about 250 of the 2,048 blocks' time
    written = [tier.contains(h) for h in hashes]
    num_written = sum(written)
    assert 0 < num_written < NUM_BLOCKS
    assert written == [True] * num_written + [False] * (NUM_BLOCKS - num_written)


def test_a_queued_block_names_the_ram_blocks_own_arrays():
    """No copy: the queue costs memory only for the blocks RAM drops while they wait."""
    k, v = mx.zeros((1, 2, BS, 8)), mx.ones((1, 2, BS, 8))
    arrays = payload_to_arrays([LayerSpec(KV)], [(k, v)])
    assert [id(a) for a in arrays.values()] == [id(k), id(v)]


def test_a_byte_bound_sheds_as_many_jobs_as_a_bigger_one_needs(tmp_path):
    manager, tier = stack(tmp_path, queue_bytes=4 * BLOCK_BYTES)
    tier.writer.hold(60)
    prefill(manager, list(range(4 * BS)))
    assert tier.writer.stats()["writer_queued_bytes"] == 4 * BLOCK_BYTES
    big = {"0.k": mx.zeros((1, 1, 2 * BS, 2)), "0.v": mx.zeros((1, 1, 2 * BS, 2))}  # two blocks' bytes
    from mlx_kvserve.kv.ssd.writer import WriteJob

    assert tier.writer.enqueue(WriteJob(b"\x07" * 32, NS, (1,) * BS, big, depth=0))
    stats = tier.writer.stats()
    assert stats["writer_shed"] == 2 and stats["writer_queued_bytes"] == 4 * BLOCK_BYTES
    tier.writer.resume()
    assert tier.close(drain_timeout_s=30)


def test_the_queue_bound_is_a_byte_size_and_the_old_count_still_loads(tmp_path):
    from mlx_kvserve.config import load_config
    from mlx_kvserve.errors import ConfigError

    path = tmp_path / "config.toml"
    path.write_text('[ssd]\nwriter_queue_bytes = "3GiB"\nwriter_queue_size = 512\n')
    ssd = load_config(path).ssd
    assert (ssd.writer_queue_bytes, ssd.writer_queue_size) == (3 * 2**30, 512)  # deprecated, still honoured
    path.write_text("[ssd]\nwriter_queue_bytes = -1\n")
    with pytest.raises(ConfigError, match="writer_queue_bytes"):
        load_config(path)


def test_a_tail_shed_from_a_full_queue_is_written_after_the_blocks(tmp_path):
    """A tail ranks below every block, so a full queue sheds it first; it is owed with its arrays and
    the drain writes it: a restart finds the tail of the prompt it repeats (the restore bench's first
    request after a restart lacked it at 16k tokens)."""
    tokens = list(range(256 * BS))
    manager, tier = stack(tmp_path)
    tier.writer.hold(60)
    hashes = prefill(manager, tokens)
    rest = (9, 8, 7)
    tier.save_tail(hashes[-1], rest, payload(-1))
    stats = tier.writer.stats()
    assert stats["writer_shed"] == 256 - 64 + 1  # the tail too: the queue is full of blocks
    assert tier.backlog_bytes() >= BLOCK_BYTES * (256 - 64) + BLOCK_BYTES
    tier.writer.resume()
    assert tier.close(drain_timeout_s=30)
    _, tier2 = stack(tmp_path)
    try:
        found = tier2.load_tail(hashes[-1], rest)
        assert found is not None and tuple(found[0]) == rest
        assert sum(map(tier2.contains, hashes)) == 256
    finally:
        tier2.close(drain_timeout_s=10)


def test_owed_tails_are_bounded_in_bytes_newest_kept(tmp_path, monkeypatch):
    from mlx_kvserve.kv.ssd import tier as tier_module

    monkeypatch.setattr(tier_module, "OWED_TAIL_BYTES", 2 * BLOCK_BYTES)
    manager, tier = stack(tmp_path)
    tier.writer.hold(60)
    hashes = prefill(manager, list(range(64 * BS)))  # the queue is full
    for i in range(4):
        tier.save_tail(hashes[-1], (100 + i,), payload(i))
    taken = tier.take_backlog(100 * BLOCK_BYTES)
    assert [tuple(j.token_ids) for j in taken] == [(102,), (103,)]  # the two newest
    tier.writer.resume()
    assert tier.close(drain_timeout_s=30)
