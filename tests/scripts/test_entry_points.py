"""scripts/' entry points through their scenario command line (harness/cli.py): every one lists its scenarios,
an unknown scenario is refused, and three cheap scenarios run end to end in a subprocess (the long-context
journey on a 1% prompt, the tiny VLM builder, a restore of a 320-token prompt)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

ENTRY_POINTS = {
    "bench_engine.py": ["lengths", "hit-blocks", "restore", "ssd-io"],
    "features.py": ["tiny-vlm", "models", "model-threads"],
    "journeys.py": ["quickstart", "hybrid-restart", "long-context"],
    "agents.py": ["session"],
}


def script(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_each_entry_point_lists_its_scenarios_and_refuses_an_unknown_one(name):
    proc = script(f"scripts/{name}", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(scenario in proc.stdout for scenario in ENTRY_POINTS[name])
    wrong = script(f"scripts/{name}", "no-such-scenario")
    assert wrong.returncode == 2 and "invalid choice: 'no-such-scenario'" in wrong.stderr


def test_the_long_context_journey_serves_a_short_prompt_end_to_end():
    proc = script("scripts/journeys.py", "long-context", "--cases", "long", "--scale", "0.01", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["case"] == "long" and row["status"] == 200 and row["error"] is None
    assert row["prompt_tokens"] == int((131072 - 64) * 0.01) and row["context_served"] == 131072


def test_the_tiny_vlm_builder_writes_a_model_folder(tmp_path):
    out = tmp_path / "vlm"
    proc = script("scripts/features.py", "tiny-vlm", "--family", "qwen2_vl", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_vl"


def test_the_restore_scenario_restores_a_short_prompt_from_the_disk_end_to_end(tmp_path):
    out = tmp_path / "out"
    args = ["restore", "--tokens", "320", "--reps", "1", "--before", "--dir", str(tmp_path), "--out", str(out)]
    proc = script("scripts/bench_engine.py", *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((out / "results.json").read_text())["results"][0]
    assert row["tokens"] == 320 and row["files"] >= 320 // 64  # at least the five full blocks were read
    assert row["cached_tokens"] == 319  # every token but the last, read back from the block files
    assert row["restore"] > 0 and row["before_restore"] > 0 and row["floor"] == row["raw_read_cold"] + row["ram_hit"]
