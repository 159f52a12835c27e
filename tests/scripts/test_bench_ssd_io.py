"""scripts/bench_engine.py ssd-io end to end on two 8B-shaped blocks (a full run uses the same code at 1 GiB)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from harness.diskio import CAN_DROP


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str, object]:
    """(results.json, report.md, the --dir folder) of one run of the script on 16 MiB."""
    tmp_path = tmp_path_factory.mktemp("ssd_io")
    out = tmp_path / "out"
    argv = ["--total-gib", str(16 / 1024), "--reps", "1", "--dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "ssd-io", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text(), tmp_path


def test_llama3_8b_block_is_8_mib(run):
    results, _, _ = run
    assert results["block_mib"] == 8  # the default shape, Llama-3-8B's


def test_report_has_raw_and_store_bandwidth_and_checksums(run):
    results, report, tmp_path = run
    bw = results["gib_s"]
    assert bw["num_blocks"] == 2 and bw["total_gib"] == 16 / 1024
    modes = ["page_cache", "cold"] if CAN_DROP else ["page_cache"]
    reads = [f"{kind}_{mode}" for kind in ("raw_read", "store_load", "store_load_chain") for mode in modes]
    ratios = ["save_vs_raw", "save_batched_vs_raw"] + [f"load{c}_vs_raw_{m}" for c in ("", "_chain") for m in modes]
    for key in ["raw_write", "store_save", "store_save_batched", *reads, *ratios]:
        assert bw[key] > 0, key
    checksums = results["checksum_ms"]
    assert len(checksums) == 3 and any(name.startswith("block_checksum as built") for name in checksums)
    assert all(ms > 0 for ms in checksums.values())
    assert "| write (+fsync) / save_block |" in report and "| block checksum |" in report
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvserve-ssdio-")]  # the work folder is gone
