"""The Anthropic Messages API (issue 13, item 5) through the official `anthropic` SDK, in process on
the tiny random models: replies and streams with Anthropic's event sequence, system blocks,
tool_use / tool_result round trips through the template, stop_sequences, cache reads in usage,
count_tokens, x-api-key, and errors in Anthropic's shape.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from starlette.testclient import TestClient
from test_api_tools import (  # noqa: F401  (fixtures)
    CALL,
    WEATHER,
    _loaded,
    scripted,
    tool_client,
    tool_engine,
    tool_loaded,
)
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.openai import parse as oa

SYSTEM = "You are a terse assistant. " * 8  # several 16-token blocks: the second turn reads them from the cache
USER = [{"role": "user", "content": "Say hello to the world."}]
GREEDY = {"temperature": 0}  # this SDK no longer names sampling fields; the API still takes them
ON = {"type": "enabled", "budget_tokens": 1024}  # the tool model's template thinks unless told not to
TOOL = {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def plain_engine(tiny_model_dir, tmp_path_factory):
    return make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path_factory.mktemp("anthropic"))


@pytest.fixture(scope="module")
def plain_client(plain_engine):
    with TestClient(create_app(plain_engine, ApiKeys("", ""))) as client:
        yield client


def sdk(client, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url="http://testserver", http_client=client, max_retries=0)


def test_a_reply_with_usage_and_cache_reads(plain_client, plain_engine):
    client = sdk(plain_client)
    first = client.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=4, extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert [b.type for b in first.content] == ["text"] and first.content[0].text
    assert first.stop_reason in ("max_tokens", "end_turn")
    prompt = len(plain_engine.chat_tokens([{"role": "system", "content": SYSTEM}, *USER]))
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == prompt
    assert first.usage.output_tokens <= 4
    second = client.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=4, extra_body=GREEDY)
    assert second.content[0].text == first.content[0].text
    assert second.usage.cache_read_input_tokens >= prompt // 16 * 16 - 16 > 0
    assert second.usage.input_tokens == prompt - second.usage.cache_read_input_tokens


def test_system_blocks_with_cache_control_render_as_the_string(plain_client):
    client = sdk(plain_client)
    blocks = [
        {"type": "text", "text": SYSTEM[:40]},
        {"type": "text", "text": SYSTEM[40:], "cache_control": {"type": "ephemeral"}},
    ]
    as_blocks = client.messages.count_tokens(model="tiny", system=blocks, messages=USER)
    as_string = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER)
    reply = client.messages.create(model="tiny", system=blocks, messages=USER, max_tokens=1)
    assert as_blocks.input_tokens == as_string.input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == as_blocks.input_tokens


def test_a_stream_has_anthropics_event_sequence(plain_client):
    client = sdk(plain_client)
    with client.messages.stream(model="tiny", messages=USER, max_tokens=6, extra_body=GREEDY) as stream:
        events = [ev.type for ev in stream]
        final = stream.get_final_message()
    kinds = [e for e in events if e not in ("text",)]  # the SDK adds "text" events of its own
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    whole = client.messages.create(model="tiny", messages=USER, max_tokens=6, extra_body=GREEDY)
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_end_the_reply_and_are_named(plain_client):
    client = sdk(plain_client)
    text = client.messages.create(model="tiny", messages=USER, max_tokens=24, extra_body=GREEDY).content[0].text
    at = next(k for k in range(2, len(text) - 2) if "\ufffd" not in text[k : k + 2] and text.find(text[k : k + 2]) == k)
    stop = text[at : at + 2]
    reply = client.messages.create(model="tiny", messages=USER, max_tokens=24, stop_sequences=[stop], extra_body=GREEDY)
    assert reply.content[0].text == text[:at]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_and_tool_result_render_through_the_template(tool_client, tool_engine):  # noqa: F811
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}]},
    ]
    counted = sdk(tool_client).messages.count_tokens(model="tool-tiny", messages=history, tools=[TOOL], thinking=ON)
    same = [
        history[0],
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "toolu_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"},
    ]
    tokens = tool_engine.chat_tokens(oa.parse_messages(same), tools=[WEATHER])
    rendered = tool_engine.loaded.tokenizer.decode(tokens)
    assert "<tool_response>sunny, 21C</tool_response>" in rendered and '"city": "Paris"' in rendered
    assert counted.input_tokens == len(tokens)


def test_tool_calls_come_back_as_tool_use_blocks(tool_client, scripted):  # noqa: F811
    scripted += ["hmm</think>", "Checking. ", CALL[:11], CALL[11:]]
    reply = sdk(tool_client).messages.create(model="tool-tiny", messages=USER, tools=[TOOL], max_tokens=50, thinking=ON)
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
    assert reply.content[0].thinking == "hmm" and reply.content[1].text == "Checking. "
    assert (reply.content[2].name, reply.content[2].input) == ("get_weather", {"city": "Paris"})
    assert reply.stop_reason == "tool_use"


def test_tool_calls_stream_as_tool_use_blocks(tool_client, scripted):  # noqa: F811
    scripted += ["hmm</think>", "Checking. ", CALL[:11], CALL[11:]]
    client = sdk(tool_client)
    with client.messages.stream(model="tool-tiny", messages=USER, tools=[TOOL], max_tokens=50, thinking=ON) as stream:
        events = [ev for ev in stream]
        final = stream.get_final_message()
    starts = [ev.content_block.type for ev in events if ev.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert json.loads(
        next(
            ev.delta.partial_json
            for ev in events
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"
        )
    ) == {"city": "Paris"}


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tool_choice": {"type": "any"}, "tools": [TOOL]}, "tool calling"),  # no tool support
        ({"tool_choice": {"type": "tool", "name": "get_weather"}, "tools": [TOOL]}, "tool calling"),
        ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "'name'"),
        ({"extra_body": {"top_k": -1}}, "'top_k'"),  # served now; a bad value is still named
        ({"tools": [TOOL | {"strict": True}]}, "tool calling"),
        ({"extra_body": {"service_tier": 1}}, "'service_tier'"),  # accepted (no meaning here), but a string
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}, "cache_control"),
        ({"tools": [TOOL]}, "tool calling"),  # the plain model has no tool support
        ({"output_config": {"effort": 3}}, "'output_config.effort'"),  # a level is a hint; not a number
        ({"extra_body": {"context_management": {"edits": [{"type": "compact"}]}}}, "'compact'"),
        ({"output_config": {"format": {"type": "json_object"}}}, "json_schema"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
            "nope",
        ),
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(plain_client, fields, words):
    body = {"model": "tiny", "max_tokens": 4, "messages": USER} | fields
    with pytest.raises(anthropic.BadRequestError) as err:
        sdk(plain_client).messages.create(**body)
    assert err.value.status_code == 400 and words in err.value.message
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


def test_missing_max_tokens_is_a_400_in_anthropics_shape(plain_client):
    reply = plain_client.post("/v1/messages", json={"model": "tiny", "messages": USER})
    assert reply.status_code == 400
    assert reply.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'max_tokens' is required"},
    }


def test_the_x_api_key_header_opens_the_api(tiny_model_dir, tmp_path):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path)
    with TestClient(create_app(engine, ApiKeys("secret", ""))) as client:
        reply = sdk(client, "secret").messages.create(model="tiny", messages=USER, max_tokens=1)
        assert reply.usage.output_tokens <= 1
        with pytest.raises(anthropic.AuthenticationError):
            sdk(client, "wrong").messages.create(model="tiny", messages=USER, max_tokens=1)


def test_thinking_and_top_level_cache_control_reach_the_template(tool_client, tool_engine):  # noqa: F811
    client = sdk(tool_client)
    on = client.messages.count_tokens(
        model="tool-tiny", messages=USER, thinking=ON, extra_body={"cache_control": {"type": "ephemeral"}}
    )
    off = client.messages.count_tokens(model="tool-tiny", messages=USER, thinking={"type": "disabled"})
    absent = client.messages.count_tokens(model="tool-tiny", messages=USER)  # Anthropic's default: off
    assert absent.input_tokens == off.input_tokens
    assert on.input_tokens == len(tool_engine.chat_tokens(USER))
    assert off.input_tokens == len(tool_engine.chat_tokens(USER, template_kwargs={"enable_thinking": False}))
    assert off.input_tokens > on.input_tokens


def test_a_messages_request_holds_an_in_flight_slot(tiny_model_dir, tmp_path):
    import asyncio
    import threading

    import httpx

    from mlx_kvserve.engine.request import Finished, TextDelta, Usage

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
            body = {"model": "tiny", "max_tokens": 4, "messages": USER}
            first = asyncio.create_task(client.post("/v1/messages", json=body))
            await asyncio.sleep(0.5)
            second = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
            release.set()
            return await first, second

    try:
        first, second = asyncio.run(scenario())
    finally:
        release.set()
        engine.stop(5)  # no lifespan ran: release the cache folder and its writer here
    assert second.status_code == 429
    assert first.status_code == 200 and first.json()["content"] == [{"type": "text", "text": "hi"}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_generation_is_an_error_in_each_apis_shape(tool_client, tool_engine, monkeypatch, stream):  # noqa: F811
    from mlx_kvserve.engine.request import Failed

    monkeypatch.setattr(tool_engine, "submit", lambda req: req.emit(Failed(RuntimeError("boom"))))
    body = {"model": "tool-tiny", "max_tokens": 4, "messages": USER, "stream": stream}
    reply = tool_client.post("/v1/messages", json=body)
    chat = tool_client.post("/v1/chat/completions", json=body)
    if stream:  # the status was sent: the error is the stream's last event
        assert reply.status_code == 200 and reply.text.rstrip().endswith("}")
        last = json.loads(reply.text.rstrip().split("\n")[-1].removeprefix("data: "))
        assert last == {
            "type": "error",
            "error": {"type": "api_error", "message": "generation failed: RuntimeError: boom"},
        }
        assert "generation failed: RuntimeError: boom" in chat.text
    else:
        assert reply.status_code == 500
        assert reply.json()["error"] == {"type": "api_error", "message": "generation failed: RuntimeError: boom"}
        assert chat.status_code == 500 and chat.json()["error"]["message"] == "generation failed: RuntimeError: boom"


def test_a_prompt_with_tools_is_cached_across_the_two_apis(tool_client, tool_engine):  # noqa: F811
    import openai

    system = "You are a coding agent. Use the tools. " * 6
    oa_client = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=tool_client, max_retries=0)
    first = oa_client.chat.completions.create(
        model="tool-tiny", messages=[{"role": "system", "content": system}, *USER], tools=[WEATHER], max_tokens=1
    )
    second = sdk(tool_client).messages.create(
        model="tool-tiny", system=system, messages=USER, tools=[TOOL], max_tokens=1, thinking=ON
    )
    prompt = first.usage.prompt_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt  # the same rendering
    assert second.usage.cache_read_input_tokens >= prompt // 16 * 16 - 16 > 0


BALL = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "blue"]}, "size": {"type": "integer", "minimum": 1}},
    "required": ["color", "size"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_output_config_holds_the_reply_to_the_schema(plain_client, stream):
    import jsonschema

    body = {
        "model": "tiny",
        "max_tokens": 60,
        "messages": USER,
        "output_config": {"format": {"type": "json_schema", "schema": BALL}},
        "extra_body": GREEDY,
    }
    if stream:
        with sdk(plain_client).messages.stream(**body) as events:
            reply = events.get_final_message()
    else:
        reply = sdk(plain_client).messages.create(**body)
    (block,) = reply.content  # the random model's reply, held to the schema
    assert block.type == "text" and reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(block.text), BALL)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_cache_control_marks_become_checkpoints_and_the_hashes_come_computed(family, tiny_model_dir, tmp_path):
    """A cache_control mark's prefix end reaches a hybrid (or sliding-window) model's engine as a
    checkpoint position, where it keeps its state; a plain model's gets none (it keeps no states):
    its marks render beside the prefill, for the lease alone. Either way the mark leases its
    prefix, and the request arrives with its prompt's block hashes already computed (once, at the edge)."""
    from familymodels import build_family_model
    from mlx_lm.utils import load

    from mlx_kvserve.engine.request import Finished, Usage
    from mlx_kvserve.models.loader import LoadedModel

    if family == "llama":
        loaded = _loaded(tiny_model_dir, "tiny")
    else:
        model, tokenizer = load(str(folder := build_family_model(tmp_path / "model", family)))
        loaded = LoadedModel("fam", folder, model, tokenizer, json.loads((folder / "config.json").read_text()), 2048)
    engine = make_engine(loaded, tmp_path / "home")
    assert engine.keeps_checkpoints == (family != "llama")
    seen = []

    def submit(req):
        seen.append(req)
        req.emit(Finished("stop", Usage(len(req.prompt_tokens), 0), 0.01))

    engine.submit = submit
    system = [{"type": "text", "text": "You answer about orchards. " * 40, "cache_control": {"type": "ephemeral"}}]
    body = {"model": loaded.name, "max_tokens": 4, "system": system, "messages": USER}
    try:
        with TestClient(create_app(engine, ApiKeys("", ""))) as client:
            assert client.post("/v1/messages", json=body).status_code == 200
            (lease,) = engine.cache_admin().leases()
            plain = dict(body, system=[{"type": "text", "text": system[0]["text"]}])
            assert client.post("/v1/messages", json=plain).status_code == 200
    finally:
        engine.stop(5)
    marked, unmarked = seen
    if family == "llama":
        assert marked.checkpoint_at == ()
    else:
        assert len(marked.checkpoint_at) == 1 and 0 < marked.checkpoint_at[0] < len(marked.prompt_tokens)
    assert unmarked.checkpoint_at == ()
    # The lease covers the system prompt's full blocks: its tip is the block before the user turn's.
    system_tokens = len(engine.chat_tokens([{"role": "system", "content": system[0]["text"]}], False))
    block = engine.prefix_cache.manager.block_size
    assert (
        lease["blocks"] == system_tokens // block
        and lease["block_hash"] == marked.block_hashes[lease["blocks"] - 1].hex()
    )
    assert marked.block_hashes == engine.block_hashes(marked.prompt_tokens) and len(marked.block_hashes) > 0
