"""Pins in the KV manager, without a model: fake payloads and a fake next tier."""

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.pins import PinRegistry
from mlx_kvserve.kv.ram import RAMStore

BS = 4


class FakeTier:
    """A next tier that keeps whatever it is given (write-through, or evict_only: blocks leaving
    RAM and blocks it is asked to persist)."""

    def __init__(self, evict_only=False):
        self.blocks = {}
        self.evict_only = evict_only

    def on_new_block(self, block):
        if not self.evict_only:
            self.blocks[block.block_hash] = block

    def on_evicted(self, blocks):
        if self.evict_only:
            self.persist(blocks)

    def persist(self, blocks):
        new = [b for b in blocks if b.block_hash not in self.blocks]
        self.blocks.update((b.block_hash, b) for b in new)
        return len(new)

    def load(self, block_hash, token_ids):
        block = self.blocks.get(block_hash)
        return (block.payload, block.nbytes) if block is not None and block.token_ids == tuple(token_ids) else None

    def load_many(self, wanted, into=None):
        out = []
        for block_hash, token_ids in wanted:
            got = self.load(block_hash, token_ids)
            if got is None:
                break
            out.append(got)
        return out

    def contains(self, block_hash):
        return block_hash in self.blocks

    def parent_of(self, block_hash):
        block = self.blocks.get(block_hash)
        return block.parent_hash if block is not None else None

    def save_tail(self, parent_hash, token_ids, payload):
        pass

    def load_tail(self, parent_hash, rest):
        return None


def manager(budget=1000, tier=None, pins=None, share=0.5) -> KVManager:
    hasher = BlockHasher(namespace_hash("m", "float32", BS), BS)
    return KVManager(hasher, RAMStore(budget), None, tier, pins or PinRegistry(None), share)


def insert_all(mgr, tokens, nbytes=100):
    for index, block_hash, parent in mgr.new_blocks(tokens, 0, len(tokens) // BS):
        mgr.cache_block(block_hash, parent, tokens[index * BS : (index + 1) * BS], f"p{index}", nbytes)
    return mgr.hasher.hash_blocks(tokens)


def cached_tokens(mgr, tokens) -> int:
    match = mgr.lookup(tokens + [0])
    mgr.release(match.blocks)
    return match.num_tokens


def test_pin_counts_the_chain_and_double_pin_needs_double_unpin():
    mgr = manager()
    hashes = insert_all(mgr, list(range(12)))
    assert mgr.pin([hashes[-1]]) == [hashes[-1]]
    assert [mgr.pins.count(h) for h in hashes] == [1, 1, 1]  # ancestors protected too
    mgr.pin([hashes[1]])
    assert [mgr.pins.count(h) for h in hashes] == [2, 2, 1]
    assert mgr.unpin([hashes[-1]]) == 1
    assert [mgr.pins.count(h) for h in hashes] == [1, 1, 0]
    assert mgr.unpin([hashes[-1]]) == 0  # no pin left on it
    assert mgr.unpin([hashes[1]]) == 1
    assert len(mgr.pins) == 0


def test_unknown_hash_pins_nothing():
    mgr = manager()
    assert mgr.pin([b"\x07" * 32]) == []
    assert mgr.unpin([b"\x07" * 32]) == 0
    assert len(mgr.pins) == 0


def test_pinned_prefix_survives_a_flood_in_ram():
    mgr = manager(budget=1000)  # 10 blocks
    system = list(range(100, 112))
    hashes = insert_all(mgr, system)
    mgr.pin([hashes[-1]])
    for n in range(40):  # a flood of other conversations, 3 blocks each
        insert_all(mgr, [n * 1000 + i for i in range(12)])
    assert cached_tokens(mgr, system) == 12
    stats = mgr.stats()
    assert stats["kv_evictions"] >= 110 and stats["kv_ram_bytes"] <= 1000
    mgr.check_integrity()


def test_pinned_blocks_are_demoted_to_the_next_tier_never_lost():
    tier = FakeTier()
    mgr = manager(budget=500, tier=tier, share=0.2)  # pinned may hold 100 bytes of RAM
    system = list(range(100, 112))
    hashes = insert_all(mgr, system)
    mgr.pin([hashes[-1]])
    for n in range(10):
        insert_all(mgr, [n * 1000 + i for i in range(12)])
    in_ram = [mgr.in_ram(h) for h in hashes]
    assert in_ram.count(True) <= 1  # over the pinned share: served from the next tier instead
    assert all(tier.contains(h) for h in hashes)
    assert cached_tokens(mgr, system) == 12  # promoted back on use
    assert mgr.stats()["kv_pinned_demotions"] >= 2
    mgr.check_integrity()


def test_evict_only_pinning_writes_the_chain_so_it_can_be_demoted():
    tier = FakeTier(evict_only=True)
    mgr = manager(budget=500, tier=tier, share=0.2)
    system = list(range(100, 112))
    hashes = insert_all(mgr, system)
    assert not any(tier.contains(h) for h in hashes)  # evict_only: nothing written yet
    mgr.pin([hashes[-1]])
    assert all(tier.contains(h) for h in hashes)  # pinning wrote the whole chain
    for n in range(10):
        insert_all(mgr, [n * 1000 + i for i in range(12)])
    assert [mgr.in_ram(h) for h in hashes].count(True) <= 1  # demoted within the share, not held in RAM
    assert mgr.stats()["kv_ram_bytes"] <= 500
    assert cached_tokens(mgr, system) == 12
    mgr.check_integrity()


def test_safety_net_without_a_next_tier_keeps_ram_bounded():
    ram = RAMStore(1000)
    mgr = KVManager(BlockHasher(namespace_hash("m", "float32", BS), BS), ram, None, None, PinRegistry(None))
    for base in (0, 100):  # two pinned prefixes of 2 blocks: 400 bytes
        hashes = insert_all(mgr, list(range(base, base + 8)))
        mgr.pin([hashes[-1]])
    ram.max_bytes = 300  # e.g. restarted with a smaller budget: pins now exceed it
    insert_all(mgr, [9000 + i for i in range(4)])  # any insert triggers eviction
    stats = mgr.stats()
    assert stats["kv_ram_bytes"] <= 300
    assert stats["kv_pinned_dropped"] >= 1
    assert stats["kv_pinned_blocks"] == 4  # the pins themselves remain
    insert_all(mgr, [7000 + i for i in range(4)])
    assert cached_tokens(mgr, [7000 + i for i in range(4)]) == 4  # requests still cache and hit


def test_flush_keeps_pinned_blocks():
    mgr = manager()
    keep = insert_all(mgr, list(range(8)))
    insert_all(mgr, list(range(50, 58)))
    mgr.pin([keep[-1]])
    result = mgr.flush()
    assert result == {"ram_dropped": 2, "ram_kept": 2}
    assert cached_tokens(mgr, list(range(8))) == 8
    assert cached_tokens(mgr, list(range(50, 58))) == 0


def test_pins_persist_across_restarts(tmp_path):
    path = tmp_path / "pins.json"
    first = PinRegistry(path)
    first.pin([b"\x01" * 32, b"\x02" * 32])
    first.pin([b"\x02" * 32])
    again = PinRegistry(path)
    assert again.count(b"\x01" * 32) == 1 and again.count(b"\x02" * 32) == 2
    again.unpin([b"\x02" * 32])
    assert PinRegistry(path).count(b"\x02" * 32) == 1
    path.write_text("{not json")
    assert len(PinRegistry(path)) == 0  # a damaged file starts empty, never crashes
