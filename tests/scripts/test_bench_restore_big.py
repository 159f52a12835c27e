"""The pieces of scripts/bench_engine.py restore (scripts/harness/engine/restore.py) that need no engine run:
the report's arithmetic and the previous read path it compares against (a full run: docs/benchmarks.md, "A restore at disk speed")."""

from __future__ import annotations

import mlx.core as mx
from harness.engine import restore as bench

from mlx_kvserve.kv.ssd.reads import StoreReads
from mlx_kvserve.kv.ssd.store import SSDStore
from mlx_kvserve.kv.ssd.table_check import ArrayRule, TableExpectation


def test_the_report_gives_each_restore_against_its_floor():
    r = {
        "tokens": 16384,
        "kv_bytes": 2 * 1024**3,
        "files": 257,
        "reps": 3,
        "raw_read_cold": 4.0,
        "raw_gib_s": 0.5,
        "ram_hit": 2.0,
        "floor": 6.0,
        "restore": 7.5,
        "tier_reads": 5.0,
        "reads_gib_s": 0.4,
        "before_restore": 12.0,
        "before_tier_reads": 9.5,
    }
    row = bench.report_lines([r])[-1]
    assert (
        row
        == "| 16384 | 2.00 | 257 | 4.000 (0.50) | 2.000 | 6.000 | 7.500 | 1.25x | 5.000 (0.40, 80%) | 12.000, 2.00x, 9.500 | - |"
    )


def test_the_previous_reads_load_the_same_chain_block_by_block_and_are_put_back(tmp_path):
    rules = TableExpectation({n: ArrayRule("float32", (1, 1, 1, 2), True, True) for n in ("0.k", "0.v")}, 2)
    store = SSDStore(tmp_path / "kv", b"\x01" * 32, table_rules=rules)
    tokens, parent, hashes = (1, 2), b"\x01" * 32, []
    for i in range(10):
        block_hash = bytes([i + 1]) * 32
        store.save_block(
            block_hash, parent, tokens, {"0.k": mx.full((1, 1, 2, 2), float(i)), "0.v": mx.zeros((1, 1, 2, 2))}
        )
        hashes.append(block_hash)
        parent = block_hash
    with bench.previous_reads():
        assert not StoreReads.run_reads
        before = store.load_blocks([(h, tokens) for h in hashes])
    assert StoreReads.run_reads
    now = store.load_blocks([(h, tokens) for h in hashes])
    assert [b.run for b in before] == [None] * 10 and now[0].run is not None and now[0].run.num_blocks == 10
    assert [b.arrays["0.k"][0, 0, 0, 0].item() for b in before] == [b.arrays["0.k"][0, 0, 0, 0].item() for b in now]
    assert len(now) == 10
