"""/v1/messages/count_tokens is bounded like the completion routes' heavy part: at most
server.max_concurrent_counts counts render and tokenize at once (issue 46: twelve 3 MB bodies counted
together took a server to 4.5 GB and slowed a small chat 40x, all within the in-flight limit); one more
gets a 429 naming the setting, a chat still runs beside them, and a finished count gives its slot back.
The tiny random model, in process; the effect on a real server: docs/benchmarks.md "count_tokens bound"."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from test_api_anthropic import _loaded
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.request import Finished, TextDelta, Usage
from mlx_kvserve.errors import ConfigError
from mlx_kvserve.server.app import create_app

USER = [{"role": "user", "content": "hi"}]
SLOW = [{"role": "user", "content": "count me slowly"}]


def test_counts_past_the_limit_get_a_429_and_a_chat_still_runs(tiny_model_dir, tmp_path):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path, max_concurrent_counts=1)
    release, started = threading.Event(), threading.Event()
    render = engine.chat_tokens

    def chat_tokens(messages, *args):  # a count of SLOW holds its thread until the test releases it
        if messages and messages[-1]["content"] == SLOW[0]["content"]:
            started.set()
            release.wait(10)
        return render(messages, *args)

    def submit(req):  # no lifespan runs here, so no worker: a reply at once
        req.emit(TextDelta("hi", 1))
        req.emit(Finished("stop", Usage(len(req.prompt_tokens), 1), 0.01))

    engine.chat_tokens, engine.submit = chat_tokens, submit
    app = create_app(engine, ApiKeys("", ""))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as client:
            slow = asyncio.create_task(client.post("/v1/messages/count_tokens", json={"messages": SLOW}))
            while not started.is_set():
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/messages/count_tokens", json={"messages": USER})
            chat = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
            release.set()
            counted = await slow
            after = await client.post("/v1/messages/count_tokens", json={"messages": USER})
            return refused, chat, counted, after

    try:
        refused, chat, counted, after = asyncio.run(scenario())
    finally:
        release.set()
        engine.stop(5)  # no lifespan ran: release the cache folder and its writer here
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "server.max_concurrent_counts" in refused.json()["error"]["message"]
    assert chat.status_code == 200, chat.text  # completions are not held back by counts
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    assert after.status_code == 200  # the slot was given back


def test_the_count_limit_is_checked():
    assert load_config(overrides={}).server.max_concurrent_counts == 2
    with pytest.raises(ConfigError, match="server.max_concurrent_counts"):
        load_config(overrides={"server": {"max_concurrent_counts": 0}})
