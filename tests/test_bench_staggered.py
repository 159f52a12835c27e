"""scripts/bench_staggered_turns.py end to end on a tiny model (full runs on SmolLM2: docs/benchmarks-history-2026-12-07.md):
both variants run every round and give the same greedy replies; the report has their rows."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_staggered_turns_both_variants(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    args = ["--model", str(tiny_model_dir), "--clients", "3", "--words", "40", "--turns", "3", "--max-tokens", "4"]
    args += ["--rounds", "2", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_staggered_turns.py", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["same_replies"] is True
    assert set(results["rounds"]) == {"product", "side prefill"}
    for rounds in results["rounds"].values():
        assert len(rounds) == 2
        assert all(r["first_ttft"] > 0 and r["later_ttft"] > 0 and r["tokens_per_s"] > 0 for r in rounds)
    report = (out / "report.md").read_text()
    assert "| product |" in report and "| side prefill |" in report
