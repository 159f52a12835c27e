"""Every request a recorded client version sent is served (issue 47): the bodies of Claude Code, Codex,
opencode, Qwen Code, Cline, aider and llm as `scripts/agents.py clients --record` saves them
(tests/data/client_requests/, long text cut: scripts/harness/agent_clients.py), replayed against the server with a
tool-calling model.
A field a client sends that the server refuses (400, 422, 404) fails here, naming client, version,
request and the server's message. The engine is scripted: parsing, the template and the reply's
shape are what is checked, not the model's answer."""

from __future__ import annotations

import threading

import pytest
from harness.agent_clients import load_all
from starlette.testclient import TestClient
from test_api_tools import _loaded
from test_hardening_wire import make_engine
from toolmodel import build_tool_model

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.request import Finished, TextDelta, Usage
from mlx_kvserve.server.app import create_app

RECORDINGS = load_all()
CASES = [
    pytest.param(
        rec, i, id=f"{rec['client']}-{rec['version']}{rec.get('how', '')}-{i + 1}-{req['method']}-{req['path']}"
    )
    for rec in RECORDINGS
    for i, req in enumerate(rec["requests"])
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    loaded = _loaded(build_tool_model(tmp_path_factory.mktemp("toolmodel") / "tool-tiny"))
    loaded.context_length = 131072  # agents' prompts: the recordings are cut, but still thousands of tokens
    engine = make_engine(loaded, tmp_path_factory.mktemp("replay"))

    def submit(req):  # a short answer, at once
        def run():
            req.emit(TextDelta("Hello.", 1))
            req.emit(Finished("stop", Usage(len(req.prompt_tokens), 1), 0.01))

        threading.Thread(target=run).start()

    engine.submit = submit
    with TestClient(create_app(engine, ApiKeys("", ""))) as test_client:
        yield test_client


def test_the_recordings_cover_every_client():
    clients = {rec["client"] for rec in RECORDINGS}
    assert {"claude-code", "codex", "opencode", "qwen-code", "cline", "aider", "llm"} <= clients
    bodies = [req["body"] for rec in RECORDINGS for req in rec["requests"] if "body" in req]
    assert any("safeguards" in body for body in bodies)  # interactive Claude Code's auto mode


@pytest.mark.parametrize("rec, index", CASES)
def test_a_recorded_request_is_served(client, rec, index):
    req = rec["requests"][index]
    body = req.get("body")
    if body is not None and "model" in body:
        body = body | {"model": "tool-tiny"}  # the clients named the model they were pointed at
    headers = {"anthropic-version": "2023-06-01"} if req["path"].startswith("/v1/messages") else {}
    reply = client.request(req["method"], req["path"], json=body, headers=headers)
    assert reply.status_code == 200, f"{rec['client']} {rec['version']} {req['method']} {req['path']}: {reply.text}"
    if body is not None and body.get("stream"):
        failed = ("event: error", '"type": "error"', '"type":"error"', "response.failed")
        assert "Hello." in reply.text and not any(word in reply.text for word in failed), reply.text[-500:]
