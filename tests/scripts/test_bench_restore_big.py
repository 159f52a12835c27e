"""The pieces of scripts/bench_engine.py restore (scripts/harness/engine/restore.py) that need no engine run:
the report's arithmetic and the previous restore it compares against (a full run: docs/benchmarks.md, "A restore at disk speed")."""

from __future__ import annotations

from harness.engine import restore as bench

from mlx_kvserve.kv import blocks


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


def test_the_previous_restore_reads_into_ram_first_and_is_put_back(tiny_model_dir):
    """--before: no lookup reads into a request's own cache (CacheLayout.direct_positions gives
    None), so the chain is read into RAM's run and the cache assembled from it; put back after."""
    from mlx_lm.utils import load

    model, _ = load(str(tiny_model_dir))
    layout = blocks.cache_layout(model, 16)
    assert layout.direct_positions(300) == 512
    with bench.previous_reads():
        assert layout.direct_positions(300) is None
    assert layout.direct_positions(300) == 512
