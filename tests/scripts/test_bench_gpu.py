"""scripts/bench_engine.py lengths end to end on a tiny shape (the GPU run uses the same code at 8B shape)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from harness.synthetic import kv_bytes_per_token, llama_config


def test_llama3_8b_shape_has_the_reference_kv_size():
    # ../shared/DEVICE.md: 128 KiB per token in fp16 for the Llama-3-8B shape.
    assert kv_bytes_per_token(llama_config("llama3-8b"), 2) == 128 * 1024


def test_cold_ram_and_ssd_after_restart(tmp_path):
    out = tmp_path / "out"
    args = ["--shape", "tiny", "--bits", "0", "--dtype", "float32", "--lengths", "128,192", "--reps", "1"]
    args += ["--work-dir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "lengths", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [row["prompt_tokens"] for row in results["lengths"]] == [160, 224]
    for row, length in zip(results["lengths"], (128, 192), strict=True):
        (rep,) = row["reps"]
        # The prefix is served from RAM, then from the SSD after the restart; the question is not.
        assert rep["cached_tokens"] == {"cold": 0, "ram": length, "ssd": length, "split": length}
        assert row["cold_s"] > 0 and row["ssd_hit_s"] > 0 and row["ssd_split_s"] > 0
        # The floor: the prefix's KV (float32 here) read at the measured raw speed, then a RAM hit.
        prefix_bytes = kv_bytes_per_token(llama_config("tiny"), 4) * length
        assert row["raw_read_gib_s"] > 0
        assert row["floor_s"] == pytest.approx(prefix_bytes / (row["raw_read_gib_s"] * 2**30) + row["ram_hit_s"])
        # Issue 44: an exact repeat reuses all but its last token (the tail too), as mlx-lm's one cache does;
        # the restore reads the whole prefix; the floor is the raw cold read plus the RAM hit.
        assert rep["issue44_cached_tokens"] == {"repeat": length + 31, "restore": length}
        assert rep["mlx_lm_reused_tokens"] == {"repeat": length + 31, "new": length}
        assert row["repeat_joined_per_layer"] == 3  # one run, the tail, the room: not one array per block
        assert row["restore_floor_s"] == pytest.approx(
            prefix_bytes / (row["raw_cold_read_gib_s"] * 2**30) + row["ram_hit_s"]
        )
        assert row["repeat_over_mlx_lm"] == pytest.approx(row["repeat_s"] / row["mlx_lm_repeat_s"])
    assert results["machine"]["shape"] == "tiny"
    report = (out / "report.md").read_text()
    assert "| 160 |" in report and "| 224 |" in report and "split / floor" in report and "Issue 44" in report


def test_compute_free_long_context_rows(tmp_path):
    # Issue 44 item 4 on a CPU: the hits beside one memory copy of the prefix, the peak RSS of the exact repeat.
    out = tmp_path / "out"
    args = ["--shape", "tiny", "--bits", "0", "--dtype", "float32", "--lengths", "256", "--reps", "1"]
    args += ["--compute-free", "--layers", "3", "--prefill-step", "64", "--warmup-tokens", "64"]
    args += ["--ram-max-bytes", "64MiB", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "lengths", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["compute_free"] and results["machine"]["layers"] == 3
    (row,) = results["lengths"]
    (rep,) = row["reps"]
    assert rep["issue44_cached_tokens"] == {"repeat": 256 + 31, "restore": 256}
    prefix_bytes = kv_bytes_per_token(llama_config("tiny", num_hidden_layers=3), 4) * 256
    assert rep["ram_blocks_bytes"] >= prefix_bytes  # the prefix is held in RAM when the repeat hits
    assert 0 < rep["rss_before_repeat_bytes"] <= rep["rss_peak_repeat_bytes"]
    assert row["copy_floor_s"] > 0
    assert row["repeat_over_copy"] == pytest.approx(row["repeat_s"] / row["copy_floor_s"])
    growth = rep["rss_peak_repeat_bytes"] - rep["rss_before_repeat_bytes"]
    assert row["rss_growth_over_prefix"] == pytest.approx(growth / prefix_bytes)
    assert "Long contexts (compute-free attention)" in (out / "report.md").read_text()


def test_peak_rss_during_sees_an_allocation():
    import mmap

    import numpy as np
    from harness.long_context import peak_rss_during

    def allocate():
        # Fresh pages from the kernel, not malloc's: the suite runs with glibc tunables that keep freed
        # pages (cpu/warm_memory), so a malloc'd buffer may reuse memory already resident.
        with mmap.mmap(-1, 64 << 20) as region:
            a = np.frombuffer(region, dtype=np.uint8)
            a[:] = 1  # touched: resident
            value = int(a[-1])
            del a
            return value

    result, before, peak = peak_rss_during(allocate)
    assert result == 1
    assert peak - before >= 60 << 20
