"""scripts/bench_decode_servers.py end to end on the tiny model, our server and mlx_lm.server (vllm-mlx is
not installed here; full runs on SmolLM2: docs/benchmarks-history-2026-12-07.md): every case measured for both servers, the
timeline has each client's two turns in order, and the report has their rows."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT
from harness import OURS, THEIRS


def test_decode_servers_and_timeline(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    args = ["--model", str(tiny_model_dir), "--clients", "1,2", "--max-tokens", "6", "--rounds", "1", "--timeline"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_decode_servers.py", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["decode"]) == {"1", "2"}
    for clients, per_server in results["decode"].items():
        assert set(per_server) == {OURS, THEIRS}
        for (run,) in per_server.values():
            assert len(run["completion_tokens"]) == int(clients)
            assert run["tokens_per_s"] > 0
    for (timeline,) in results["timeline"].values():
        requests = timeline["requests"]
        assert len(requests) == 8  # 4 clients x 2 turns
        for c in range(4):
            first, second = sorted((r for r in requests if r["client"] == c), key=lambda r: r["turn"])
            assert first["start"] <= first["first"] <= first["last"] <= second["start"] <= second["first"]
    report = (out / "report.md").read_text()
    assert f"| 2 | {OURS} |" in report and f"Timeline, {THEIRS}, round 1" in report
