"""scripts/bench.py --scenarios concurrent's measurement and report without a model: vllm-mlx's command, C = 16
clients, the cold first turns' p99 / max and issue 26's targets, against fake OpenAI-style servers
(vllm-mlx is not installed here; full runs: docs/benchmarks.md); --rounds' alternating order, new
prompts per round and median ratios, on a stand-in for each run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from harness import OURS, THEIRS, VLLM
from harness.scenarios import concurrent, concurrent_rounds
from harness.servers import BOUNDED_MLX_LM_SERVER as BOUNDED
from harness.servers import Server, free_port, stop_servers, vllm_mlx_server

# A streaming /v1/chat/completions stand-in. Like vllm-mlx it rejects a body without a model; with
# --reject-model it rejects one with a model, as mlx_lm.server would try to load a model by that name.
# It writes its argv and HOME to $HOME/argv.json.
FAKE_SERVER = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
home = os.environ["HOME"]
os.makedirs(home, exist_ok=True)
with open(os.path.join(home, "argv.json"), "w") as f:
    json.dump({"argv": argv, "home": home}, f)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if ("model" in body) == ("--reject-model" in argv):
            self.send_response(422)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(0.002)
            chunk = {"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())


ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path) -> Path:
    path = tmp_path / "fake-server"
    path.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    path.chmod(0o755)
    return path


def fake(name: str, script: Path, home: Path, *extra: str) -> Server:
    port = free_port()
    cmd = [str(script), "serve", "model", "--port", str(port), *extra]
    return Server(name, cmd, port, dict(os.environ, HOME=str(home)), "/v1/models")


def test_three_servers_sixteen_clients_and_the_report(fake_server, tmp_path):
    vllm = vllm_mlx_server(str(fake_server), tmp_path / "model", tmp_path / "vllm-home")
    servers = [
        fake(OURS, fake_server, tmp_path / "ours"),
        fake(THEIRS, fake_server, tmp_path / "theirs", "--reject-model"),
        vllm,
    ]
    try:
        for server in servers:
            server.wait(server.ready_path, timeout=30)
        result = concurrent.scenario_concurrent(servers, [1, 16], 2, 4, 20)
    finally:
        stop_servers(servers)
    # vllm-mlx as bench_claude_session runs it: batching and prefix cache on, "default", a fresh HOME
    started = json.loads((tmp_path / "vllm-home" / "argv.json").read_text())
    assert started["argv"][:2] == ["serve", str(tmp_path / "model")]
    assert {"--continuous-batching", "--enable-prefix-cache"} <= set(started["argv"])
    assert started["argv"][started["argv"].index("--served-model-name") + 1] == "default"
    for name in (OURS, THEIRS, VLLM):
        run = result[name]["C=16"]
        assert "error" not in run, run
        assert [len(turn) for turn in run["ttft"]] == [16, 16]
        assert run["completion_tokens"] == 16 * 2 * 4
        first = sorted(run["ttft"][0])
        assert first[-2] <= run["ttft_p99"][0] <= run["ttft_max"][0] == first[-1]
    lines = concurrent.report_lines(result, [s.name for s in servers])
    assert "| case | turn | mlx-kvserve TTFT mean / p90 s | mlx_lm.server TTFT mean / p90 s | " in lines[2]
    assert lines[2].endswith("| ours / mlx_lm.server | ours / vllm-mlx |")
    assert sum(line.startswith("| 16 | ") for line in lines) == 3 + 3  # a row per server, per measure
    assert any(line.startswith("| 16 | later turns, mean TTFT | ") for line in lines)


def case(ttft: list[list[float]], tokens_per_s: float) -> dict:
    return {
        "ttft": ttft,
        "ttft_mean": [sum(t) / len(t) for t in ttft],
        "ttft_p90": [max(t) for t in ttft],
        "ttft_p99": [concurrent.percentile(t, 99) for t in ttft],
        "ttft_max": [max(t) for t in ttft],
        "tokens_per_s": tokens_per_s,
    }


def test_the_targets_are_ratios_ours_over_each_peer_and_a_failed_peer_is_reported():
    result = {"clients": [4, 16], "turns": 2, "max_tokens": 16, "system_words": 300}
    result[OURS] = {
        "C=4": case([[6.0, 8.0, 10.0, 12.0], [1.0, 1.0, 1.0, 1.0]], 5.5),
        "C=16": case([[10.0] * 16, [3.0] * 16], 4.0),
        "shared8": case([[2.0] * 8], 3.0),
    }
    result[THEIRS] = {
        "C=4": case([[20.0] * 4, [2.0] * 4], 5.0),
        "C=16": case([[20.0] * 16, [5.0] * 16], 4.0),
        "shared8": case([[9.0] * 8], 1.0),
    }
    result[VLLM] = {
        "C=4": case([[9.0] * 4, [0.5] * 4], 4.0),
        "C=16": {"error": "ReadTimeout: timed out (log /tmp/x.log)"},
        "shared8": case([[9.0] * 8], 1.0),
    }
    lines = concurrent.report_lines(result, [OURS, THEIRS, VLLM])
    # first turn at C=4: mean 9, p99 between the two largest, max 12
    assert "| 4 | mlx-kvserve | 9.00 | 11.94 | 12.00 | 1.00 | 5.5 |" in lines
    assert "| 4 | later turns, mean TTFT | 0.50x met | 2.00x **missed** |" in lines
    assert "| 4 | first turn (cold), mean TTFT | 0.45x met | 1.00x |" in lines
    assert "| 4 | tokens/s | 1.10x met | 1.38x met |" in lines
    assert "| 16 | later turns, mean TTFT | 0.60x **missed** | - |" in lines  # 16 clients: <= 0.5x
    assert "| 16 | vllm-mlx | failed | | | | |" in lines
    assert "| C=16 | 1 | 10.00 / 10.00 | 20.00 / 20.00 | failed | 0.50x | - |" in lines
    assert lines[-1] == "- vllm-mlx C=16 failed: ReadTimeout: timed out (log /tmp/x.log)"
    # bench.py's two-server form: one ratio column
    two = concurrent.report_lines({k: v for k, v in result.items() if k != VLLM}, [OURS, THEIRS])
    assert "| 4 | tokens/s | 1.10x met |" in two


def test_rounds_alternate_the_order_on_new_prompts_and_the_targets_take_the_median_ratio(monkeypatch):
    # round r's figures per server: first-turn TTFT, later-turns TTFT, tokens/s
    figures = {
        OURS: [(6.0, 1.0, 5.5), (9.0, 1.0, 4.0), (5.0, 1.0, 6.0)],
        THEIRS: [(10.0, 2.0, 5.0), (10.0, 1.0, 5.0), (10.0, 4.0, 5.0)],
        VLLM: [(9.0, 0.5, 4.0), (9.0, 0.5, 4.0), (9.0, 0.5, 4.0)],
    }
    calls = []

    def fake_run_case(server, label, systems, turns, max_tokens):
        calls.append((server.name, label, systems))
        first, later, tokens_per_s = figures[server.name][int(label.rsplit(" ", 1)[1]) - 1]
        return case([[first] * len(systems), [later] * len(systems)][:turns], tokens_per_s)

    monkeypatch.setattr(concurrent_rounds, "run_case", fake_run_case)
    servers = [SimpleNamespace(name=n) for n in (OURS, THEIRS, VLLM)]
    result = concurrent_rounds.scenario_rounds(servers, [4], 2, 16, 20, 3)
    forward, backward = [OURS, THEIRS, VLLM], [VLLM, THEIRS, OURS]
    assert [runs["order"]["C=4"] for runs in result["rounds"]] == [forward, backward, forward]
    assert [name for name, label, _ in calls if label.startswith("C=4")] == forward + backward + forward
    assert [label for _, label, _ in calls[:3]] == ["C=4 round 1"] * 3
    # every round on its own prompts, the round leading the nonce: no round meets another's cache
    prompts = [set(systems) for name, _, systems in calls if name == THEIRS]
    assert all(a.isdisjoint(b) for i, a in enumerate(prompts) for b in prompts[i + 1 :])
    assert all(p.startswith("Session round2-") for _, label, systems in calls if "round 2" in label for p in systems)
    # the per-round raw figures stay in the results
    assert result["rounds"][1][OURS]["C=4"]["ttft"][0] == [9.0] * 4

    lines = concurrent_rounds.rounds_report_lines(result, [OURS, THEIRS, VLLM])
    assert "| C=4 | 2 | 1 | vllm-mlx | 9.00 | 0.50 | 4.0 |" in lines  # round 2 reversed: vllm-mlx first
    assert "| C=4 | 2 | 3 | mlx-kvserve | 9.00 | 1.00 | 4.0 |" in lines
    assert "| shared8 | 1 | 1 | mlx-kvserve | 6.00 | - | 5.5 |" in lines
    assert (
        "| C=4 | first turn (cold), mean TTFT | ours / mlx_lm.server | 0.60x | 0.90x | 0.50x | 0.60x | 0.50x - 0.90x |"
        in lines
    )
    assert (
        "| C=4 | later turns, mean TTFT | ours / mlx_lm.server | 0.50x | 1.00x | 0.25x | 0.50x | 0.25x - 1.00x |"
        in lines
    )
    assert not any(line.startswith("| shared8 | later turns") for line in lines)  # one turn
    # the targets on the median ratios
    assert any("on the median ratio over 3 rounds" in line for line in lines)
    assert "| 4 | later turns, mean TTFT | 0.50x met | 2.00x **missed** |" in lines
    assert "| 4 | first turn (cold), mean TTFT | 0.60x met | 0.67x |" in lines
    assert "| 4 | tokens/s | 1.10x met | 1.38x met |" in lines


def test_on_a_gpu_with_its_own_memory_the_servers_get_equal_bounds(tiny_model_dir, monkeypatch):
    """Two servers sharing a CUDA GPU each get the same bounds on MLX's buffer cache and on KV caches
    (with MLX's defaults they ran an H100 out of memory at 16 clients): ours in its config, also under
    a variant's, mlx_lm.server by --prompt-cache-bytes and its cache limit set before it starts. CUDA
    is faked in this process; the servers run on the CPU, where an explicit limit applies as well."""
    import mlx.core as mx
    from harness.clients import chat_ttft
    from harness.servers import start_servers
    from harness.variants import variant_server

    from mlx_kvserve.engine.memory import device as device_memory

    monkeypatch.setattr(device_memory, "arrays_in_device_memory", lambda: True)
    # 32 GiB: the servers' explicit KV budgets (4 GiB) within this machine's memory plan, which refuses more
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 32 * 1024**3})
    share = 32 * 1024**3 // 8  # a quarter of the GPU between two servers
    servers = start_servers(tiny_model_dir)
    try:
        servers.append(variant_server(servers[0], "fifo"))
        ours, theirs, fifo = servers
        assert theirs.cmd[1:3] == ["-c", BOUNDED] and theirs.cmd[3] == str(share)
        assert theirs.cmd[theirs.cmd.index("--prompt-cache-bytes") + 1] == str(share)
        assert chat_ttft(theirs, [{"role": "user", "content": "hello"}], 2)[0] > 0  # it serves
        for server in (ours, fifo):
            body = httpx.get(server.url + "/health", timeout=10).json()
            assert body["memory"]["buffer_cache_limit_bytes"] == share
            assert body["cache"]["kv_ram_max_bytes"] == share - share // 8
        assert httpx.get(fifo.url + "/health", timeout=10).json()["batch"]["scheduling"] == "fifo"
    finally:
        stop_servers(servers)
