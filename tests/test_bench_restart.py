"""The pieces of scripts/bench_restart_hit.py and bench_write_interference.py that need no model:
the raw-read floor and the reports' arithmetic (scripts/harness: diskio.py, restart.py; full runs:
docs/benchmarks.md)."""

from __future__ import annotations

import os

from harness import diskio, restart


def test_the_raw_read_floor_reads_every_file(tmp_path):
    files = []
    for i in range(3):
        path = tmp_path / f"{i:02d}" / f"block{i}.safetensors"
        path.parent.mkdir()
        path.write_bytes(os.urandom(100_000))
        files.append(path)
    assert sorted(diskio.block_files(tmp_path)) == files
    for cold in (False, True) if diskio.CAN_DROP else (False,):
        assert diskio.raw_read_s(files, cold) > 0


def test_the_restart_report_compares_each_hit_with_cold_and_the_floor():
    r = {
        "prompt_tokens": 6000,
        "kv_mib": 270.0,
        "reps": 2,
        "cold_s": 60.0,
        "ram_hit_s": 0.5,
        "cached_tokens": {"read": 5999, "split": 5999},
        "split_computed_blocks": {"read": 0, "split": 4},
        "read_page_cache": 2.0,
        "split_page_cache": 1.5,
        "floor_page_cache": 1.0,
    }
    lines = restart.restart_report_lines(r)
    assert "| read, files page cache | 2.000 | 30.0x | 1.000 | 2.00x |" in lines
    assert "| split, files page cache | 1.500 | 40.0x | 1.000 | 1.50x |" in lines
    assert not any("files cold" in line for line in lines)


def test_the_write_report_gives_the_slowdown_and_the_writer_share():
    h = {
        "busy_s": 11.0,
        "idle_s": 10.0,
        "slowdown": 1.1,
        "queued_mib": 200.0,
        "writer_mib_s": 350.0,
        "raw_write_mib_s": 500.0,
        "writer_vs_raw": 0.7,
    }
    lines = restart.interference_report_lines({"reps": 2, "holds": {"2.0": h}})
    assert lines[-1] == "| 2.0 | 200 | 11.00 | 10.00 | +10% | 350 | 500 | 0.70x |"


def test_raw_write_measures_a_positive_bandwidth_and_leaves_nothing(tmp_path):
    assert diskio.raw_write_bps(tmp_path, 1 << 20) > 0
    assert list(tmp_path.iterdir()) == []
