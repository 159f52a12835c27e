"""KV manager, RAM tier and hashing without a model: fake payloads with a byte size."""

import random

import pytest

from mlx_kvserve.chain import BlockHasher, framed
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.kv.tails import TailStore

BS = 4


def manager(budget=1000, hasher=None) -> KVManager:
    return KVManager(hasher or BlockHasher(namespace_hash("m", "float32", BS), BS), RAMStore(budget))


def insert_all(mgr: KVManager, tokens, nbytes=100) -> int:
    added = 0
    for index, block_hash, parent in mgr.new_blocks(tokens, 0, len(tokens) // BS):
        added += mgr.cache_block(block_hash, parent, tokens[index * BS : (index + 1) * BS], f"payload-{index}", nbytes)
    return added


# --- hashing ---------------------------------------------------------------------------------


def test_hashes_chain_on_the_parent():
    h = BlockHasher(namespace_hash("m", "float32", BS), BS)
    a = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hash_blocks([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(a[0]) == 32
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 2, different parent
    assert h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # the partial block is not hashed
    assert h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], num_blocks=1) == a[:1]


def test_namespaces_separate_models_dtypes_and_block_sizes():
    spaces = {
        namespace_hash("m", "float32", 4),
        namespace_hash("n", "float32", 4),
        namespace_hash("m", "float16", 4),
        namespace_hash("m", "float32", 8),
        namespace_hash("m", "float32", 4, layout=2),
    }
    assert len(spaces) == 5
    tokens = list(range(8))
    assert BlockHasher(namespace_hash("m", "float32", 4), 4).hash_blocks(tokens) != BlockHasher(
        namespace_hash("n", "float32", 4), 4
    ).hash_blocks(tokens)


def test_framing_prevents_aliasing_of_parts():
    assert framed(b"ab", b"c") != framed(b"a", b"bc")
    assert namespace_hash("ab", "c", 4) != namespace_hash("a", "bc", 4)


def test_large_token_ids_are_not_truncated():
    h = BlockHasher(b"n" * 32, 1)
    assert h.hash_blocks([1]) != h.hash_blocks([1 + 2**16])


# --- manager / RAM tier -------------------------------------------------------------------------


def test_lookup_returns_longest_verified_chain_and_references_it():
    mgr = manager()
    tokens = list(range(12))
    assert insert_all(mgr, tokens) == 3
    match = mgr.lookup(tokens + [99, 98])
    assert match.num_tokens == 12 and [b.token_ids for b in match.blocks] == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
    ]
    assert all(b.ref_count == 1 for b in match.blocks)
    partial = mgr.lookup(list(range(8)) + [50, 51, 52, 53])
    assert partial.num_tokens == 8
    capped = mgr.lookup(tokens, max_tokens=11)
    assert capped.num_tokens == 8
    for m in (match, partial, capped):
        mgr.release(m.blocks)
    assert all(b.ref_count == 0 for b in match.blocks)
    stats = mgr.stats()
    assert stats["kv_lookups"] == 3 and stats["kv_hits"] == 3 + 2 + 2 and stats["kv_hit_tokens"] == 28
    assert stats["kv_misses"] == 1  # only the divergent lookup looked for a block that was not there
    mgr.check_integrity()


def test_lru_eviction_under_a_byte_budget():
    mgr = manager(budget=300)
    insert_all(mgr, [1, 1, 1, 1])  # A
    insert_all(mgr, [2, 2, 2, 2])  # B
    insert_all(mgr, [3, 3, 3, 3])  # C
    mgr.release(mgr.lookup([1, 1, 1, 1, 0]).blocks)  # touch A: B is now least recently used
    insert_all(mgr, [4, 4, 4, 4])  # D: over budget, B goes
    assert mgr.lookup([2, 2, 2, 2, 0]).num_tokens == 0
    for first in (1, 3, 4):
        m = mgr.lookup([first] * 4 + [0])
        assert m.num_tokens == 4
        mgr.release(m.blocks)
    stats = mgr.stats()
    assert stats["kv_evictions"] == 1 and stats["kv_ram_bytes"] == 300 and stats["kv_ram_blocks"] == 3
    mgr.check_integrity()


def test_referenced_blocks_are_never_evicted():
    mgr = manager(budget=200)
    insert_all(mgr, [1, 1, 1, 1, 2, 2, 2, 2])
    held = mgr.lookup([1, 1, 1, 1, 2, 2, 2, 2, 0])
    assert held.num_tokens == 8
    insert_all(mgr, [5, 5, 5, 5])  # no room: the new, unreferenced block is the one evicted
    again = mgr.lookup([1, 1, 1, 1, 2, 2, 2, 2, 0])
    assert again.num_tokens == 8
    assert mgr.lookup([5, 5, 5, 5, 0]).num_tokens == 0
    mgr.release(again.blocks)
    mgr.release(held.blocks)
    mgr.check_integrity()


class ConstantHasher(BlockHasher):
    """Every block of every prompt gets the same hash: forces collisions."""

    def hash_blocks(self, tokens, num_blocks=None, known=(), root=None):
        n = len(tokens) // self.block_size if num_blocks is None else min(num_blocks, len(tokens) // self.block_size)
        return [b"\x01" * 32] * n


def test_injected_hash_collision_is_a_counted_miss():
    mgr = manager(hasher=ConstantHasher(b"n" * 32, BS))
    insert_all(mgr, [1, 2, 3, 4])
    match = mgr.lookup([9, 9, 9, 9, 0])
    assert match.num_tokens == 0 and match.blocks == []
    assert mgr.stats()["kv_collisions"] == 1
    ok = mgr.lookup([1, 2, 3, 4, 0])
    assert ok.num_tokens == 4
    mgr.release(ok.blocks)
    # Registering different tokens under an existing hash is refused and counted too.
    assert not mgr.cache_block(b"\x01" * 32, b"n" * 32, [7, 7, 7, 7], "other", 100)
    assert mgr.stats()["kv_collisions"] == 2
    mgr.check_integrity()


def test_duplicate_registration_is_deduplicated():
    mgr = manager()
    assert insert_all(mgr, [1, 2, 3, 4]) == 1
    assert insert_all(mgr, [1, 2, 3, 4]) == 0  # new_blocks skips what RAM already holds
    h = mgr.hasher.hash_blocks([1, 2, 3, 4])[0]
    assert not mgr.cache_block(h, mgr.hasher.namespace, [1, 2, 3, 4], "again", 100)
    assert mgr.stats()["kv_dedup"] == 1 and mgr.stats()["kv_ram_blocks"] == 1


@pytest.mark.parametrize("seed", range(5))
def test_integrity_holds_through_random_operations(seed):
    rng = random.Random(seed)
    mgr = manager(budget=rng.choice([300, 700, 2000]))
    held = []
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(4, 24))] for _ in range(15)]
    for _ in range(300):
        op = rng.random()
        prompt = rng.choice(prompts)
        if op < 0.4:
            insert_all(mgr, prompt, nbytes=rng.choice([50, 100, 150]))
        elif op < 0.7:
            match = mgr.lookup(prompt)
            for i, block in enumerate(match.blocks):
                assert block.token_ids == tuple(prompt[i * BS : (i + 1) * BS])
            held.append(match)
        elif held:
            mgr.release(held.pop(rng.randrange(len(held))).blocks)
        mgr.check_integrity()
    for match in held:
        mgr.release(match.blocks)
    mgr.check_integrity()
    assert mgr.stats()["kv_in_use_blocks"] == 0


# --- tails (partial blocks) ---------------------------------------------------------------------


def tails_manager(budget=1000, tail_budget=400) -> KVManager:
    return KVManager(BlockHasher(namespace_hash("m", "float32", BS), BS), RAMStore(budget), TailStore(tail_budget))


def test_tail_extends_a_match_by_the_shared_prefix():
    mgr = tails_manager()
    insert_all(mgr, [1, 2, 3, 4])
    parent = mgr.hasher.hash_blocks([1, 2, 3, 4])[0]
    assert mgr.cache_tail(parent, [5, 6, 7], "tail", 30)
    match = mgr.lookup([1, 2, 3, 4, 5, 6, 9, 9])
    assert match.num_tokens == 6 and match.tail_tokens == 2 and match.tail_payload == "tail"
    capped = mgr.lookup([1, 2, 3, 4, 5, 6, 7], max_tokens=6)
    assert capped.num_tokens == 6 and capped.tail_tokens == 2
    other_parent = mgr.lookup([9, 9, 9, 9, 5, 6])
    assert other_parent.num_tokens == 0 and other_parent.tail_tokens == 0
    for m in (match, capped, other_parent):
        mgr.release(m.blocks)
    assert mgr.stats()["kv_tail_hits"] == 2 and mgr.stats()["kv_tail_hit_tokens"] == 4
    mgr.check_integrity()


def test_tails_supersede_their_prefixes_and_stay_within_budget():
    mgr = tails_manager(tail_budget=100)
    ns = mgr.hasher.namespace
    assert mgr.cache_tail(ns, [1, 2], "short", 20)
    assert mgr.cache_tail(ns, [1, 2, 3], "long", 30)  # covers [1, 2]: replaces it
    assert not mgr.cache_tail(ns, [1], "shorter", 10)  # already covered
    assert mgr.stats()["kv_tails"] == 1 and mgr.stats()["kv_tail_bytes"] == 30
    assert mgr.cache_tail(ns, [7, 7], "a", 40)
    assert mgr.cache_tail(ns, [8, 8], "b", 40)  # 110 bytes > 100: the least recently used goes
    stats = mgr.stats()
    assert stats["kv_tails"] == 2 and stats["kv_tail_bytes"] == 80
    assert mgr.lookup([1, 2, 3, 4]).tail_tokens == 0  # [1, 2, 3] was the oldest
    assert mgr.lookup([8, 8, 0]).tail_tokens == 2
    mgr.check_integrity()


def test_model_fingerprint_follows_weights_not_the_conversion_marker(tmp_path):
    from mlx_kvserve.kv.hashing import model_fingerprint

    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "mlx_kvserve_conversion.json").write_text('{"source": "/old/path.gguf"}')
    first = model_fingerprint(tmp_path)
    (tmp_path / "mlx_kvserve_conversion.json").write_text('{"source": "/moved/path.gguf"}')
    assert model_fingerprint(tmp_path) == first  # moving the source file keeps the cache
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert model_fingerprint(tmp_path) != first
    memo = tmp_path.parent / f"{tmp_path.name}-memo.json"  # outside the model folder
    assert model_fingerprint(tmp_path, memo) == model_fingerprint(tmp_path, memo)


def test_model_fingerprint_sees_weights_edited_in_place_with_the_mtime_restored(tmp_path):
    """Same size, same mtime, new bytes: the memo must not hand back the old digest."""
    import json
    import os

    from mlx_kvserve.kv.hashing import model_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"A" * 4096)
    memo = tmp_path / "fingerprints.json"
    first = model_fingerprint(model, memo)
    before = weights.stat()
    with open(weights, "r+b") as f:  # edit in place: same inode, same size
        f.seek(100)
        f.write(b"B" * 8)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    edited = model_fingerprint(model, memo)
    assert edited != first
    assert edited == model_fingerprint(model)  # what a memo-less run computes from the bytes
    assert len(json.loads(memo.read_text())) == 3  # config + both versions of the weights


def test_model_fingerprint_memo_is_used_for_unchanged_files(tmp_path, monkeypatch):
    from mlx_kvserve.kv import hashing

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    memo = tmp_path.parent / f"{tmp_path.name}-memo.json"
    first = hashing.model_fingerprint(tmp_path, memo)
    calls = []
    monkeypatch.setattr(hashing, "_file_digest", lambda p: calls.append(p) or "0" * 64)
    assert hashing.model_fingerprint(tmp_path, memo) == first and calls == []
