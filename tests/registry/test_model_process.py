"""A model in a process of its own (`[[models]] process = true`, server/model_process.py): real servers
(`mlx-kvserve run`) on two tiny random-weight llamas. Its replies equal that model's served in the
server's own process (completions, a stream, /v1/messages); it unloads by ending its process and a reload
is an SSD hit with the same text; a killed model process is started again and a killed server takes its
model processes with it; eight first requests at once start one process; the child takes requests only
with the key its server sends; a response it stored is found, continued and deleted through its server; a model
that cannot load is a 500 and the other model goes on serving."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import tinymodel

from mlx_kvserve.config import load_config
from mlx_kvserve.model_entries import ModelEntry, load_model_entries
from mlx_kvserve.server.model_config import child_config_text

BS = 16
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(4 * BS + 5)]  # 4 full blocks and a tail


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return tinymodel.build_mlx_model(tmp_path_factory.mktemp("tiny-b") / "tiny-wide", seed=1, hidden_size=96)


def write_config(path, a, b, b_process: bool = True, b_source: str | None = None, ssd_max_bytes: int = 0):
    path.write_text(
        f"""[cache]
block_size = {BS}
[ssd]
async_writes = false
max_bytes = {ssd_max_bytes}

[[models]]
name = "a"
source = "{a}"

[[models]]
name = "b"
source = "{b_source or b}"
aliases = ["bee"]
process = {"true" if b_process else "false"}
"""
    )
    return path


@pytest.fixture
def servers(start_server, tiny_model_dir, other_model, tmp_path):
    """(a server with b in its own process, a server with b in its own process space: the reference)."""

    def start(b_process: bool = True, b_source: str | None = None):
        name = "process" if b_process else "inline"
        config = write_config(tmp_path / f"{name}.toml", tiny_model_dir, other_model, b_process, b_source)
        return start_server(tiny_model_dir, config=config, home=tmp_path / f"home-{name}")

    return start


def complete(server, model: str = "b", prompt=PROMPT, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def eventually(read, holds, timeout_s: float = 30.0):
    """`read()` once `holds(it)` (the child's figures reach its server at its next /health poll, every
    second on a quiet machine); the last reading when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if holds(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def rows(server) -> dict[str, dict]:
    body = httpx.get(f"{server.base_url}/v1/cache/models", timeout=10).json()
    return {row["id"]: row for row in body["models"]}


def streamed_text(server, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    text = ""
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


def token_counters(server) -> dict[str, float]:
    """This server's /metrics token counters: prompt, cached_prompt, completion."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = {}
    for kind in ("prompt", "cached_prompt", "completion"):
        line = next(x for x in text.splitlines() if x.startswith(f"mlx_kvserve_{kind}_tokens_total "))
        found[kind] = float(line.split()[1])
    return found


def messages_text(server, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    reply = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["content"][0]["text"]


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_the_child_config_is_the_servers_with_one_pinned_entry_on_loopback(tmp_path):
    config = load_config(overrides={"cache": {"block_size": 32, "pin_on_start": ["x.txt"]}, "server": {"port": 9}})
    entry = ModelEntry("b", "/models/b", aliases=("bee",), process=True, kv_bits=8, keep_alive_s=5.0)
    path = tmp_path / "child.toml"
    path.write_text(child_config_text(config, entry, 4321, "k-123"))
    child = load_config(path)
    assert (child.server.host, child.server.port, child.server.api_key) == ("127.0.0.1", 4321, "k-123")
    assert child.cache.block_size == 32 and child.cache.pin_on_start == []
    assert child.ssd == config.ssd and child.generation == config.generation
    (only,) = load_model_entries(path)
    assert (only.name, only.source, only.aliases, only.kv_bits) == ("b", "/models/b", ("bee",), 8)
    assert only.pinned and only.preload and not only.process


def test_its_replies_equal_the_model_served_in_the_servers_own_process(servers):
    inline = servers(b_process=False)
    expected = {
        "completion": complete(inline)["choices"][0]["text"],
        "stream": streamed_text(inline, "bee"),
        "messages": messages_text(inline, "b"),
        "a": complete(inline, "a")["choices"][0]["text"],
    }
    inline.stop()
    server = servers()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # eight first requests: one process starts
        replies = list(pool.map(lambda _: complete(server), range(8)))
    assert {r["choices"][0]["text"] for r in replies} == {expected["completion"]}
    assert all(r["model"] == "b" for r in replies)
    row = rows(server)["b"]
    assert (row["state"], row["loads"], row["process"]["starts"]) == ("loaded", 1, 1)
    assert row["process"]["serving"] and row["weights_bytes"] > 0
    assert streamed_text(server, "bee") == expected["stream"]
    assert messages_text(server, "b") == expected["messages"]
    assert complete(server, "a")["choices"][0]["text"] == expected["a"]  # the model in this process
    assert complete(server)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BS  # its RAM cache
    health = httpx.get(f"{server.base_url}/health", timeout=10).json()
    b_row = next(m for m in health["models"] if m["id"] == "b")
    assert health["status"] == "ok" and b_row["cache"]["enabled"] and b_row["batch"]["max_batch"] >= 1
    listed = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve", "models", "--url", server.base_url, "list"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    pids = {line.split()[0]: line.split()[-1] for line in listed.splitlines()[2:] if line.strip()}
    assert (pids["a"], pids["b"]) == ("-", str(row["process"]["pid"]))
    # A response stored by the model's process is found through this server, continued, and deleted.
    url = f"{server.base_url}/v1/responses"
    first = httpx.post(url, json={"model": "b", "input": "hello", "max_output_tokens": 4}, timeout=60).json()
    assert httpx.get(f"{url}/{first['id']}", timeout=10).json()["id"] == first["id"]
    body = {"model": "b", "input": "and then?", "max_output_tokens": 4, "previous_response_id": first["id"]}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    assert httpx.delete(f"{url}/{first['id']}", timeout=10).json()["deleted"] is True
    assert httpx.get(f"{url}/{first['id']}", timeout=10).status_code == 404
    assert httpx.get(f"{url}/resp_none", timeout=10).json()["error"]["code"] == "response_not_found"
    # A client that leaves mid-stream stops the generation in the model's process.
    body = {"model": "b", "prompt": "hello", "max_tokens": 1500, "temperature": 0, "stream": True}
    body["logit_bias"] = {"2": -100}  # never its end token (<|im_end|>): 1500 tokens take seconds unless cancelled
    decoded = b_row["batch"]["decode_tokens"]
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 3:
                break

    def b_batch() -> dict:
        health = httpx.get(f"{server.base_url}/health", timeout=10).json()
        return next(m for m in health["models"] if m["id"] == "b")["batch"]

    batch = eventually(b_batch, lambda b: b["running"] == 0)
    assert batch["running"] == 0 and batch["decode_tokens"] - decoded < 1000, batch
    # The child listens on loopback and answers only its server's key.
    port = row["process"]["port"]
    refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "b", "prompt": "x"}, timeout=10)
    assert refused.status_code == 401


def test_unloading_ends_its_process_and_a_reload_is_an_ssd_hit(servers):
    server = servers()
    first = complete(server)
    pid = rows(server)["b"]["process"]["pid"]
    reply = httpx.post(f"{server.base_url}/v1/cache/models/unload", json={"model": "b"}, timeout=120)
    assert reply.status_code == 200 and reply.json()["state"] == "unloaded"
    assert gone(pid, 5)
    again = complete(server)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BS
    row = rows(server)["b"]
    assert (row["loads"], row["unloads"]) == (2, 1) and row["process"]["pid"] != pid


def test_a_killed_model_process_is_started_again_and_leaves_with_its_server(servers):
    server = servers()
    first = complete(server)["choices"][0]["text"]
    pid = rows(server)["b"]["process"]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert complete(server)["choices"][0]["text"] == first  # waited for the new process
    row = rows(server)["b"]
    assert row["process"]["starts"] == 2 and row["process"]["pid"] != pid and row["state"] == "loaded"
    child = row["process"]["pid"]
    server.proc.kill()  # the server dies without a word: its model process follows
    server.proc.wait()
    assert gone(child, 10)


def test_a_model_process_that_cannot_load_is_a_500_and_the_other_model_serves(servers, tmp_path):
    server = servers(b_source=str(tmp_path / "no-such-model"))
    reply = httpx.post(f"{server.base_url}/v1/completions", json={"model": "b", "prompt": "hi"}, timeout=120)
    assert reply.status_code == 500 and "failed to load" in reply.json()["error"]["message"]
    assert rows(server)["b"]["state"] == "unloaded"
    assert complete(server, "a")["choices"][0]["text"]


def test_a_model_process_keeps_its_ssd_share_and_its_requests_count_in_the_servers_metrics(
    start_server, tiny_model_dir, other_model, tmp_path
):
    budget = 1024 * 1024
    config = write_config(tmp_path / "budget.toml", tiny_model_dir, other_model, ssd_max_bytes=budget)
    server = start_server(tiny_model_dir, config=config, home=tmp_path / "home-budget")
    complete(server, prompt=[5, *PROMPT])
    one_prompt = eventually(lambda: rows(server)["b"]["ssd_bytes"], bool)
    assert one_prompt and one_prompt < budget // 8
    written = 1
    while written * one_prompt < budget:  # more than its share
        complete(server, prompt=[6 + written, *PROMPT], max_tokens=1)
        written += 1
    share = budget // len(rows(server))  # an equal share per registered model
    models = eventually(lambda: rows(server), lambda m: m["b"]["ssd_bytes"] >= share - 2 * one_prompt)
    row = models["b"]
    assert row["process"]["ssd_max_bytes"] == share
    assert share - 2 * one_prompt <= row["ssd_bytes"] <= share, (row["ssd_bytes"], one_prompt)
    health = httpx.get(f"{server.base_url}/health", timeout=10).json()
    assert health["ssd_budget_bytes"] == budget and health["ssd_used_bytes"] >= share  # lent: counted whole
    # Its requests count in this server's /metrics as a model served here would: a stream without
    # usage of its own included (the child closes it with a usage comment for its server).
    chat = {"model": "b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    usage = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60).json()["usage"]
    before = token_counters(server)
    assert streamed_text(server, "b")
    after = token_counters(server)
    assert after["prompt"] - before["prompt"] == usage["prompt_tokens"]
    assert 0 < after["cached_prompt"] - before["cached_prompt"] <= usage["prompt_tokens"]  # the same prompt again
    assert after["completion"] - before["completion"] == usage["completion_tokens"] > 0
    complete(server, "a")
    unloaded = httpx.post(f"{server.base_url}/v1/cache/models/unload", json={"model": "b"}, timeout=120)
    assert unloaded.status_code == 200
    health = httpx.get(f"{server.base_url}/health", timeout=10).json()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "home-budget").rglob("*.safetensors"))
    assert row["ssd_bytes"] <= health["ssd_used_bytes"] <= budget and on_disk <= budget  # b's folder at rest counted
    at_rest = rows(server)["b"]
    assert at_rest["state"] == "unloaded" and share - 2 * one_prompt <= at_rest["ssd_bytes"] <= share  # still known
