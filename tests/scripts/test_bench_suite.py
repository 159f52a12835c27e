"""scripts/bench.py, the source of the docs' reference figures, end to end: --quick with two scenarios on a
tiny model (~20 s), both servers started, every figure in results.json and the report written. The full
suite on the default model: docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys

import tinymodel
from conftest import ROOT


def test_bench_quick_runs_end_to_end(tmp_path):
    # The system prompt scenario's prompt is ~5k tokens of this byte-level tokenizer: a context to hold it.
    model = tinymodel.build_mlx_model(tmp_path / "tiny-llama", max_position_embeddings=8192)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlx_kvserve.cpu.blas_exec", sys.executable, "scripts/bench.py", "--quick"]
    cmd += ["--scenarios", "system,decode", "--model", str(model), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["scenarios"] == ["system", "decode"]
    ours, theirs = results["system_prompt"]["mlx-kvserve"], results["system_prompt"]["mlx_lm.server"]
    for key in ("repeat", "new_question"):
        # Both caches serve the shared prefix; ours cuts it in 64-token blocks plus a tail.
        assert ours["cached"][key] > 4000 and abs(ours["cached"][key] - theirs["cached"][key]) < 64, (ours, theirs)
    assert all(ours[k] > 0 and theirs[k] > 0 for k in ("cold", "repeat", "new_question"))
    decode = results["decode"]
    assert decode["ours_tps"] > 0 and decode["ratio"] == decode["ours_tps"] / decode["mlx_lm_tps"]
    report = (out / "report.md").read_text()
    assert "## Targets" in report and "## System prompt" in report
