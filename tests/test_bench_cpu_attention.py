"""scripts/bench_cpu_attention.py on a small shape (the full shape's figures: docs/benchmarks.md): the
written-out attention it times matches MLX's fast attention, and every part is timed."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_cpu_attention_parts(tmp_path):
    out = tmp_path / "out"
    args = ["--new-tokens", "7", "--context", "90", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_cpu_attention.py", *args, "--reps", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["score_elements"] == 4 * 7 * 97  # heads x new tokens x (context + new)
    assert results["max_abs_diff_written_out_vs_fast"] < 1e-4
    rows = results["ms_per_layer"]
    assert results["max_abs_diff_softmax_pow2"] < 1e-5  # the rewrite computes the same softmax
    assert len(rows) == 13 and all(ms > 0 for ms in rows.values())
    assert "| mx.fast.scaled_dot_product_attention |" in (out / "report.md").read_text()
