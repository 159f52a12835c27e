"""scripts/' entry points through their scenario command line (harness/cli.py): every one lists its scenarios,
an unknown scenario is refused, and cheap scenarios run end to end in a subprocess (the long-context
journey on a 1% prompt, the tiny VLM builder, a restore of a 320-token prompt, the real `llm` client for two turns;
a client not installed named with its install command)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from mlx_kvserve.launch.clients import CLIENTS

ENTRY_POINTS = {
    "bench_engine.py": ["lengths", "hit-blocks", "restore", "ssd-io"],
    "features.py": ["tiny-vlm", "models", "model-threads"],
    "journeys.py": ["quickstart", "hybrid-restart", "long-context"],
    "agents.py": ["session", "clients", "record"],
}


def script(*args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


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


def test_the_clients_scenario_names_the_install_command_of_a_client_not_installed(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # an empty folder: no client on PATH (the venv's bin has none asked)
    args = ["clients", "--clients", "claude,codex", "--out", str(tmp_path / "out")]
    proc = script("scripts/agents.py", *args, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]  # none installed: nothing ran, no server started
    for name in ("claude", "codex"):
        assert f"{name}: not installed; install it with: {CLIENTS[name].install}" in proc.stdout
    assert not (tmp_path / "out").exists()
    wrong = script("scripts/agents.py", "clients", "--clients", "claude,notepad", env=env)
    assert wrong.returncode == 1 and "unknown client(s) notepad" in wrong.stderr


LLM = shutil.which("llm", path=str(Path(sys.executable).parent))  # `make setup` installs it (the test extras)


def test_the_clients_scenario_runs_the_real_llm_client_and_records_its_requests(tmp_path):
    if LLM is None:  # skipped on a venv without it; CI must not turn green with the real client's run dropped
        missing = "the llm client is not installed in the venv (pip install -e '.[test]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {missing}")
        pytest.skip(missing)
    from harness.agent_clients import load_all
    from harness.agent_model import build_model

    model = build_model(tmp_path / "model", 4096, 12.0)
    args = ["--clients", "llm", "--model", str(model), "--record", "--data", str(tmp_path / "data")]
    proc = script(
        "scripts/agents.py", "clients", *args, "--out", str(tmp_path / "out"), "--timeout", "120", timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = (tmp_path / "out").iterdir()
    [row] = json.loads((run_dir / "results.json").read_text())["results"]
    assert len(list((run_dir / "requests").glob("*POST_v1_chat_completions.json"))) == 2  # each body kept
    assert row["client"] == "llm" and row["works"] and row["failure"] == ""
    assert row["turn2_prompt"] > row["turn1_prompt"] > 0  # turn 2 resends turn 1 with the reply and "again"
    assert row["turn2_cached"] >= row["turn1_prompt"] - 1  # ... and finds turn 1's prompt cached
    [rec] = load_all(tmp_path / "data")
    version = subprocess.run([LLM, "--version"], capture_output=True, text=True).stdout.split()[-1]
    assert (rec["client"], rec["version"]) == ("llm", version)
    chats = [r["body"] for r in rec["requests"] if r["method"] == "POST" and r["path"] == "/v1/chat/completions"]
    assert len(chats) == 2 and chats[0]["messages"] == [{"role": "user", "content": "say hi"}]
    assert chats[1]["messages"][-1] == {"role": "user", "content": "again"}


def test_the_sdk_runs_are_python_that_defines_its_tool_before_use():
    from harness.agent_clients import SDK_SCRIPTS, SDK_TURNS, WEATHER

    assert set(SDK_SCRIPTS) == set(SDK_TURNS) == {"agents", "langchain", "litellm"}
    for name, script in SDK_SCRIPTS.items():
        code = compile(WEATHER + script, name, "exec")  # a syntax error in a script run only with the SDK installed
        assert "get_weather" in code.co_names or "schema" in code.co_names, name
