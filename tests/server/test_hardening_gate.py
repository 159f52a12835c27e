"""What the gate and the router answer around the routes (issue 23, weaknesses): a trailing slash is a 404,
never a redirect built from the Host header; /v1/messages/count_tokens holds an in-flight slot like the
completion routes; the request log names the error of a 4xx the app answered; a streamed reply cancels its
generation however the response ends. The tiny random model, in process."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest
from starlette.requests import ClientDisconnect
from starlette.testclient import TestClient
from test_api_anthropic import _loaded
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta, Usage
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.sse import GenerationStream

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ApiKeys("", "")), follow_redirects=False) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/messages/", "/v1/models/"])
def test_a_trailing_slash_is_a_404_not_a_redirect(client, path):
    method = client.get if path == "/v1/models/" else client.post
    # A Host the guard lets through (an unknown name gets 421 first: test_local_guard.py), on another port.
    reply = method(path, headers={"Host": "localhost:9"}, **({} if method == client.get else {"json": {}}))
    assert reply.status_code == 404, reply.text
    assert "location" not in reply.headers
    assert reply.json()["error"]["type"] == "invalid_request_error" and path in reply.json()["error"]["message"]


def test_count_tokens_holds_an_in_flight_slot(tiny_model_dir, tmp_path):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path, max_concurrent=1)
    release = threading.Event()

    def submit(req):  # a reply that waits for the test: the request stays in flight until then
        def run():
            release.wait(10)
            req.emit(TextDelta("hi", 1))
            req.emit(Finished("stop", Usage(len(req.prompt_tokens), 1), 0.01))

        threading.Thread(target=run).start()

    engine.submit = submit
    app = create_app(engine, ApiKeys("", ""))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            first = asyncio.create_task(client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}))
            await asyncio.sleep(0.5)
            counted = await client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": USER})
            responses = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})
            release.set()
            done = await first
            return done, counted, responses, await client.post("/v1/messages/count_tokens", json={"messages": USER})

    try:
        first, counted, responses, after = asyncio.run(scenario())
    finally:
        release.set()
        engine.stop(5)  # no lifespan ran: release the cache folder and its writer here
    assert first.status_code == 200
    assert counted.status_code == 429 and counted.headers["retry-after"] == "1"
    assert responses.status_code == 429  # a Responses request is a completion: it needs the slot too
    assert after.status_code == 200 and after.json()["input_tokens"] > 0  # the slot was given back


@pytest.mark.parametrize(
    "path, body, error",
    [
        ("/v1/chat/completions", {"messages": USER, "top_p": 7}, "error=invalid_request_error"),
        ("/v1/chat/completions", {"messages": USER, "model": "other"}, "error=model_not_found"),
        ("/v1/chat/completions", {"messages": USER, "best_of": 2}, "error=unsupported_field"),
        ("/v1/messages", {"messages": USER}, "error=invalid_request_error"),  # no max_tokens
        ("/v1/messages/count_tokens", {"messages": []}, "error=invalid_request_error"),
        ("/v1/nowhere", {}, "error=invalid_request_error"),
    ],
)
def test_the_request_log_names_the_error_of_an_app_4xx(client, caplog, path, body, error):
    caplog.set_level(logging.INFO, logger="mlx_kvserve.requests")
    reply = client.post(path, json=body)
    assert 400 <= reply.status_code < 500, reply.text
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mlx_kvserve.requests"]
    fields = dict(part.split("=", 1) for part in line.split())
    assert fields["status"] == str(reply.status_code), line
    assert f"error={fields['error']}" == error, line


def test_a_stream_whose_client_is_gone_before_its_first_event_cancels_its_generation():
    gen_req = GenerationRequest("chatcmpl-x", [1, 2], SamplingParams(100), emit=lambda ev: None)

    async def events():  # cancels in its finally, but only once started: here it never is
        try:
            yield "data: {}\n\n"
        finally:
            gen_req.cancel()

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(GenerationStream(events(), gen_req)(scope, receive, send))
    assert gen_req.cancelled.is_set()


def test_the_root_answers_a_connectivity_check(client):
    """Claude Code sends `HEAD /` to its base URL before each run."""
    assert client.head("/").status_code == 200
    reply = client.get("/")
    assert reply.status_code == 200 and reply.json()["name"] == "mlx-kvserve"
    # and interactive Claude Code `HEAD /api/hello` (Anthropic's own health check) at start
    assert client.head("/api/hello").status_code == 200 and client.get("/api/hello").status_code == 200
