"""Keep-alives while a streamed request's model loads (issue 27): the stream's headers come at once, then
SSE comments (OpenAI, Responses) or Anthropic `ping` events until the model is loaded, then the reply as
the loaded model streams it. A load that fails ends the stream with an error event; a request the route
refuses once the model is loaded does too. On a tiny random-weight llama whose load is slowed here."""

from __future__ import annotations

import json
import time

import pytest
from starlette.testclient import TestClient

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.errors import ModelLoadError
from mlx_kvserve.model_entries import ModelEntry
from mlx_kvserve.registry.front import RoutedEngine
from mlx_kvserve.registry.load import load_engine
from mlx_kvserve.registry.registry import ModelRegistry
from mlx_kvserve.server import sse
from mlx_kvserve.server.app import create_app

LOAD_DELAY_S = 0.8
PING_S = 0.1


def slow_loader(entry, config):
    time.sleep(LOAD_DELAY_S)
    if entry.name == "broken":
        raise ModelLoadError("cannot load 'broken': no such folder")
    return load_engine(entry, config)


@pytest.fixture
def client(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sse, "KEEP_ALIVE_S", PING_S)
    config = load_config(overrides={"ssd": {"cache_dir": str(tmp_path / "kv")}})
    entries = (ModelEntry("a", str(tiny_model_dir)), ModelEntry("broken", str(tmp_path / "nothing")))
    registry = ModelRegistry(config, entries, loader=slow_loader)
    with TestClient(create_app(RoutedEngine(registry), ApiKeys("", ""), registry)) as c:
        yield c


CHAT = {"model": "a", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}


def streamed(client: TestClient, path: str, body: dict, headers: dict | None = None) -> tuple[int, str, list[str]]:
    with client.stream("POST", path, json=body, headers=headers or {}) as reply:
        lines = [line for line in reply.iter_lines() if line]
        return reply.status_code, reply.headers["content-type"], lines


def before_first_data(lines: list[str], skip: str = "") -> list[str]:
    """The lines before the first data line (other than those holding `skip`)."""
    out = []
    for line in lines:
        if line.startswith("data:") and (not skip or skip not in line):
            break
        out.append(line)
    return out


def test_openai_stream_gets_comments_while_its_model_loads_then_the_same_text(client):
    status, kind, lines = streamed(client, "/v1/chat/completions", dict(CHAT, stream=True))
    assert status == 200 and kind.startswith("text/event-stream")
    head = before_first_data(lines)
    assert len(head) >= LOAD_DELAY_S / PING_S / 2 and set(head) == {": keep-alive"}
    text = "".join(
        (json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        for line in lines
        if line.startswith("data: {")
    )
    assert lines[-1] == "data: [DONE]"
    whole = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    assert text == whole and text
    # Loaded now: a stream starts with its first chunk, as without several models.
    _, _, again = streamed(client, "/v1/chat/completions", dict(CHAT, stream=True))
    assert again[0].startswith("data: {")


def test_anthropic_stream_gets_pings_while_its_model_loads(client):
    body = dict(CHAT, stream=True)
    status, _, lines = streamed(client, "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert status == 200
    events = [line[7:] for line in lines if line.startswith("event: ")]
    start = events.index("message_start")
    assert start >= LOAD_DELAY_S / PING_S / 2 and set(events[:start]) == {"ping"}
    assert events[-1] == "message_stop"


def test_a_failed_load_ends_the_stream_with_its_error(client):
    status, _, lines = streamed(client, "/v1/chat/completions", dict(CHAT, model="broken", stream=True))
    assert status == 200 and lines[0] == ": keep-alive"
    error = json.loads(lines[-1][6:])["error"]
    assert "no such folder" in error["message"]
    _, _, lines = streamed(
        client, "/v1/messages", dict(CHAT, model="broken", stream=True), {"anthropic-version": "2023-06-01"}
    )
    assert lines[-2] == "event: error" and json.loads(lines[-1][6:])["type"] == "error"


def test_a_request_refused_after_the_load_ends_the_stream_with_the_refusal(client):
    body = dict(CHAT, stream=True, max_tokens=-3)  # the route's parser refuses it once the model is there
    status, _, lines = streamed(client, "/v1/chat/completions", body)
    assert status == 200 and lines[0] == ": keep-alive"
    error = json.loads(lines[-1][6:])["error"]
    assert error["param"] == "max_tokens"
