"""scripts/bench_answer_start.py and bench_join.py end to end on the tiny model (full runs on the kv-heavy
shape: docs/benchmarks-history-2026-12-07.md): every variant answers every rep with its token times in order, the floors
are measured, and the reports have their rows."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def run_script(script: str, args: list[str]) -> None:
    proc = subprocess.run([sys.executable, f"scripts/{script}", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_answer_start_times_each_token_of_every_variant(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    run_script(
        "bench_answer_start.py",
        ["--model", str(tiny_model_dir), "--words", "40", "--reps", "2"] + ["--tokens", "4", "--out", str(out)],
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results["times"]) == {"borrowed", "copied", "borrowed without speculation"}
    for reps in results["times"].values():
        assert len(reps) == 2
        for times in reps:
            assert 1 <= len(times) <= 4 and times == sorted(times) and times[0] > 0
    assert all(s > 0 for s in results["copy_s"])
    report = (out / "report.md").read_text()
    assert "| borrowed |" in report and "| copied |" in report


def test_join_measures_the_questions_forward_as_a_floor(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    run_script("bench_join.py", ["--model", str(tiny_model_dir), "--words", "40", "--reps", "2", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    forward = results["times"]["floor: the question's forward, KV in place"]
    assert len(forward) == 2 and all(t > 0 for t in forward)
    assert all(hit > 0 for hit in results["cached"]["join in place"])
    assert "floor: the question's forward" in (out / "report.md").read_text()
