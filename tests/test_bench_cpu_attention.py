"""scripts/bench_cpu_attention.py on a small shape (the full shape's figures: docs/benchmarks-history-2026-12-07.md): the
written-out attention and the server's (NumPy softmax, causal blocks) it times match MLX's fast attention,
and every part is timed; scripts/bench_cpu_prefill.py's prefill with MLX's attention and the server's on the
tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_cpu_attention_parts(tmp_path):
    out = tmp_path / "out"
    args = ["--new-tokens", "130", "--context", "20", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    args += ["--block-rows", "64"]  # three blocks of the 130 new tokens
    proc = subprocess.run(
        [sys.executable, "scripts/bench_cpu_attention.py", *args, "--reps", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["score_elements"] == 4 * 130 * 150  # heads x new tokens x (context + new)
    assert results["max_abs_diff_written_out_vs_fast"] < 1e-4
    rows = results["ms_per_layer"]
    assert results["max_abs_diff_softmax_pow2"] < 1e-5  # the rewrite computes the same softmax
    assert results["max_abs_diff_numpy_softmax_vs_fast"] < 1e-4  # the server's CPU attention: the same
    assert len(rows) == 15 and all(ms > 0 for ms in rows.values())
    assert "| mx.fast.scaled_dot_product_attention |" in (out / "report.md").read_text()


def test_cpu_prefill_with_and_without_the_block_attention(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    args = ["--model", str(tiny_model_dir), "--tokens", "300", "--step", "256", "--rows", "64", "--reps", "1"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_cpu_prefill.py", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["tokens"] for r in runs] == [300, 300]  # plain cache and batch cache
    for run in runs:
        assert run["same_argmax"] and run["max_logit_diff"] < 1e-3
        assert set(run["times"]) == {"mlx", "numpy softmax", "as installed"}
        assert all(t > 0 for times in run["times"].values() for t in times)


def test_cpu_attention_shapes(tmp_path):
    """scripts/bench_cpu_attention_shapes.py: each case timed both ways, the path the rule took (a short
    decode step stays MLX's, a prompt chunk takes the NumPy softmax), the outputs matching MLX's."""
    out = tmp_path / "out"
    args = ["--shapes", "2x2x16", "--cases", "decode:1:64,cold:256:512,turn:100:900", "--reps", "1", "--rows", "64"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_cpu_attention_shapes.py", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["kind"], r["path"]) for r in runs] == [("decode", "mlx"), ("cold", "numpy"), ("turn", "numpy")]
    assert all(r["diff"] < 1e-4 and r["mlx_ms"] > 0 and r["ours_ms"] > 0 for r in runs)
    assert "| 2x2x16 | cold | 256 | 512 |" in (out / "report.md").read_text()
