"""What a newcomer meets (issue 49): `GET /` pointing to /ui and the API, the dashboard address in the
startup log, /ui's polls kept out of the INFO log."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from starlette.testclient import TestClient
from test_api_anthropic import _loaded
from test_hardening_wire import make_engine

from mlx_kvserve.cache_cli import pin_message
from mlx_kvserve.cache_summary import summary
from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.build import ssd_summary
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.kv.ssd.upkeep import ValidationReport
from mlx_kvserve.models.gguf import convert_weights
from mlx_kvserve.progress import progress_bar
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.gate import QUIET_ENDPOINTS
from mlx_kvserve.server.root_page import dashboard_url


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path_factory.mktemp("newcomer"))


def test_the_root_points_to_the_dashboard_and_the_api(engine, caplog):
    with caplog.at_level(logging.INFO), TestClient(create_app(engine, ApiKeys("", ""))) as client:
        body = client.get("/").json()
        page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
        assert client.head("/").status_code == 200
    assert body["dashboard"] == "/ui" and body["links"]["health"] == "/health"
    assert body["links"]["chat_completions"] == "/v1/chat/completions" and body["name"] == "mlx-kvserve"
    assert page.headers["content-type"].startswith("text/html")
    assert '<a href="/ui">' in page.text and '<a href="/health">' in page.text and "tiny" in page.text
    assert "dashboard: http://127.0.0.1:8000/ui" in caplog.text


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000/ui"),
        ("0.0.0.0", "http://127.0.0.1:8000/ui"),
        ("::1", "http://[::1]:8000/ui"),
    ],
)
def test_the_dashboard_address_is_one_to_open(host, url):
    assert dashboard_url(host, 8000) == url


def test_cache_stats_summary_counts_tail_hits_and_reads_in_gib():
    stats = {
        "enabled": True,
        "kv_hit_tokens": 0,
        "kv_tail_hit_tokens": 900,  # every hit a tail: kv_hits alone would read 0
        "kv_ram_bytes": 2**29,
        "kv_ram_max_bytes": 4 * 2**30,
        "kv_ram_blocks": 13,
        "kv_pinned_blocks": 13,
        "kv_pinned_ram_bytes": 2**20,
        "ssd_bytes": 3 * 2**30,
        "ssd_max_bytes": 0,
        "ssd_blocks": 40,
        "writer_written": 40,
    }
    text = summary(stats, {"batch": {"prefill_tokens": 100}})
    assert "cache hits: 90% of prompt tokens (900 of 1,000: 0 in blocks, 900 in tails)" in text
    assert "RAM: 0.50 GiB of 4.00 GiB, 13 blocks" in text and "SSD: 3.00 GiB (no budget), 40 blocks" in text
    assert "pins: 13 blocks pinned (1.0 MiB of them in RAM)" in text and "writer: 40 written" in text
    several = summary({"models": {"a": stats, "b": {"enabled": False, "reason": "embedding"}}}, None)
    assert several.splitlines()[0] == "[a]" and "[b]\n  cache: off (embedding)" in several
    assert "900 prompt tokens served from the cache" in several  # no prefill count: no share claimed


def test_pin_reports_blocks_not_chains():
    assert pin_message({"pinned_count": 1, "tokens": 13 * 64}, 64) == "pinned 13 blocks (832 tokens) as 1 chain"


def test_the_ssd_startup_line_reads_as_a_sentence(tmp_path):
    report = ValidationReport(
        kept=12, dropped_missing=0, adopted=2, deleted_invalid=0, deleted_temp=1, evicted=0, elapsed_s=0.0123
    )
    stats = {"ssd_bytes": 2**30, "ssd_max_bytes": 8 * 2**30, "ssd_blocks": 14}
    line = ssd_summary(tmp_path, stats, "write_through", True, report, 0)
    assert line == (
        f"SSD tier: 14 blocks (1.00 of 8.00 GiB) in {tmp_path}, write_through; "
        "checked in 0.01 s: 2 adopted, 1 temp files deleted"
    )
    clean = report._replace(adopted=0, deleted_temp=0)
    line = ssd_summary(tmp_path, stats | {"ssd_max_bytes": 0}, "write_back", False, clean, 0)
    assert "(1.00 GiB, no budget)" in line and line.endswith("write_back, as a guest; checked in 0.01 s: all sound")


def test_ui_polls_are_logged_at_debug():
    assert {"/v1/cache/requests", "/v1/cache/pins", "/health", "/metrics"} <= QUIET_ENDPOINTS


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = os.environ | {"MLX_KVSERVE_HOME": str(tmp_path / "home")}
        args = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(tmp_path / "no-such-model"), "--port"]
        started = time.monotonic()
        done = subprocess.run([*args, str(port)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: in use" in done.stderr  # not the missing model: never loaded
    assert "no-such-model" not in done.stderr and time.monotonic() - started < 60


def test_conversion_reports_each_tensor_and_converts_the_same():
    import mlx.core as mx

    weights = {"token_embd.weight": mx.ones((4, 8)), "output_norm.weight": mx.full((8,), 2.0)}
    calls = []
    counted, _ = convert_weights(weights, "float16", on_tensor=lambda: calls.append(1))
    plain, _ = convert_weights(weights, "float16")
    assert len(calls) == len(weights) and counted.keys() == plain.keys() and len(plain) == 2
    assert all(mx.array_equal(counted[k], plain[k]).item() and plain[k].dtype == mx.float16 for k in plain)


def test_progress_bars_stay_off_without_a_terminal(capsys):
    with progress_bar(3, "checking", "block") as bar:  # pytest's stderr is no terminal
        bar.update(3)
    assert bar.disable and capsys.readouterr().err == ""


def test_health_shows_a_long_prefill_in_progress(tiny_model_dir, tmp_path, monkeypatch):
    """A prompt prefilled in 16-token steps: /health's batch lists it (tokens done of total) while it runs."""
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    overrides = {"generation": {"prefill_step_size": 16}, "ssd": {"enabled": False}}
    engine = Engine(_loaded(tiny_model_dir, "tiny"), load_config(overrides=overrides))
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(1500)]
    seen: list[dict] = []
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        reply = threading.Thread(target=client.post, args=("/v1/completions",), kwargs={"json": body})
        reply.start()
        while reply.is_alive():
            seen += client.get("/health").json()["batch"]["prefilling"]
        reply.join()
        assert client.get("/health").json()["batch"]["prefilling"] == []  # done: nothing in progress
    assert seen, "never saw the prefill in progress"
    assert all(p["total"] >= 1400 and 0 < p["done"] < p["total"] for p in seen), seen[:3]
    assert [p["done"] for p in seen] == sorted(p["done"] for p in seen)  # it only moves forward
