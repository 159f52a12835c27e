"""The OpenAI Responses API (issue 24, item 2) through the official `openai` client: `POST /v1/responses`
is served by the same chat path, engine and cache as `/v1/chat/completions` (the same greedy text),
streams the event sequence the SDK parses, round-trips function calls, continues a stored response
with `previous_response_id` from the cache, holds `text.format` by constrained decoding, accepts tool
types it cannot run, and answers bad input with 4xx naming the field."""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient
from test_api_structured import SCHEMA
from test_api_tools import _loaded
from test_hardening_wire import make_engine
from toolmodel import build_tool_model

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.request import Finished, TextDelta, Usage
from mlx_kvserve.errors import NotFoundError
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.responses import parse as rs
from mlx_kvserve.server.responses.routes import LEASE_TTL_S
from mlx_kvserve.server.responses.store import ResponseStore

INSTRUCTIONS = "You are a terse assistant. Answer in one short sentence, and never use lists. " * 3
QUESTION = "What colour is the sky on a clear day?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HOSTED = [
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "custom", "name": "apply_patch", "description": "edit files"},
    {"type": "namespace", "name": "mcp", "tools": []},
]


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client, max_retries=0)


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path_factory.mktemp("responses"))
    with TestClient(create_app(engine, ApiKeys("", ""))) as c:
        yield c


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory):
    loaded = _loaded(build_tool_model(tmp_path_factory.mktemp("toolmodel") / "tool-tiny"))
    return make_engine(loaded, tmp_path_factory.mktemp("responses-tools"))


@pytest.fixture(scope="module")
def tool_client(tool_engine):
    with TestClient(create_app(tool_engine, ApiKeys("", ""))) as c:
        yield c


@pytest.fixture
def scripted(tool_engine, monkeypatch):
    """The engine answers every request with the deltas in `script["text"]` and "stop"; the prompts
    it was given are in `script["prompts"]`."""
    script: dict[str, list] = {"text": [], "prompts": []}

    def submit(req):
        script["prompts"].append(list(req.prompt_tokens))

        def run():
            for text in script["text"]:
                req.emit(TextDelta(text, 1))
            req.emit(Finished("stop", Usage(len(req.prompt_tokens), len(script["text"])), 0.01))

        threading.Thread(target=run).start()

    monkeypatch.setattr(tool_engine, "submit", submit)
    return script


# --- text, streaming, limits ----------------------------------------------------------------------------


def test_plain_text_is_the_chat_endpoints_greedy_text(client):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = sdk(client).chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    reply = sdk(client).responses.create(
        model="tiny", instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=12
    )
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].annotations == []
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens


def test_streamed_deltas_make_the_whole_text(client):
    whole = sdk(client).responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=12)
    events = list(
        sdk(client).responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=12, stream=True)
    )
    final = events[-1].response  # the SDK's stream helper only finishes on response.completed, not .incomplete
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_max_output_tokens_makes_the_response_incomplete(client):
    reply = sdk(client).responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=2)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 2 and reply.max_output_tokens == 2


# --- stored responses -------------------------------------------------------------------------------------


def test_previous_response_id_continues_from_the_cache(client):
    api = sdk(client)
    # Greedy: a sampled reply of the random model can be whitespace, which the template renders apart.
    first = api.responses.create(
        model="tiny", instructions=INSTRUCTIONS, input="Hi", max_output_tokens=6, temperature=0
    )
    follow = api.responses.create(
        model="tiny",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=4,
        temperature=0,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16  # all but a partial block
    assert api.responses.retrieve(first.id).output_text == first.output_text


def test_stored_responses_can_be_retrieved_and_deleted(client):
    api = sdk(client)
    kept = api.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert api.responses.retrieve(kept.id).id == kept.id
    api.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(kept.id)
    unstored = api.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)


def test_an_unknown_previous_response_id_is_a_404_naming_it(client):
    reply = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "previous_response_id": "resp_nope"})
    assert reply.status_code == 404
    assert reply.json()["error"]["param"] == "previous_response_id"


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(max_entries=2)
    for rid in ("a", "b", "c"):
        store.put({"id": rid, "output": []}, [])
    with pytest.raises(NotFoundError):
        store.get("a")
    assert store.history("b") == [] and store.get("c").body["id"] == "c"


# --- leases: a stored response's prefix, a prompt_cache_key's prompt -----------------------------------------


@pytest.fixture
def leasing(tiny_model_dir, tmp_path):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path)
    with TestClient(create_app(engine, ApiKeys("", ""))) as c:
        yield engine, c
    engine.stop(0)


def leased_prompt(engine, c, **fields) -> tuple[list[dict], list[int]]:
    """The leases after one greedy request with `fields`, and its prompt's tokens."""
    body = {"model": "tiny", "instructions": INSTRUCTIONS, "input": QUESTION, "max_output_tokens": 6, "temperature": 0}
    assert c.post("/v1/responses", json=body | fields).status_code == 200
    prompt = engine.chat_tokens([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    return c.get("/v1/cache/pins").json()["leases"], prompt


def survives_a_flush(engine, c, tokens: list[int]) -> bool:
    """Whether the full blocks of `tokens` are still in RAM after a flush of the unpinned ones."""
    c.post("/v1/cache/flush", json={})
    return all(engine.prefix_cache.manager.in_ram(h) for h in engine.cache_admin().block_hashes(tokens))


def test_a_stored_response_leases_its_conversation_for_five_minutes(leasing):
    engine, c = leasing
    (lease,), prompt = leased_prompt(engine, c)  # store: true by default
    assert lease["ttl_s"] == LEASE_TTL_S == 300.0
    assert lease["blocks"] >= len(prompt) // 16  # the prompt's full blocks, and the output's that follow
    assert survives_a_flush(engine, c, prompt)


def test_store_false_leases_nothing(leasing):
    engine, c = leasing
    leases, prompt = leased_prompt(engine, c, store=False)
    assert leases == [] and not survives_a_flush(engine, c, prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_cache_key_leases_the_prompt(leasing, stream):
    engine, c = leasing
    (lease,), prompt = leased_prompt(engine, c, store=False, prompt_cache_key="conv-1", stream=stream)
    hashes = engine.cache_admin().block_hashes(prompt)
    assert lease["block_hash"] == hashes[-1].hex() and lease["blocks"] == len(hashes)
    assert survives_a_flush(engine, c, prompt)


def test_a_bad_prompt_cache_key_is_a_422(client):
    reply = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "prompt_cache_key": 7})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "prompt_cache_key"


# --- structured output, tools -------------------------------------------------------------------------------


def test_text_format_json_schema_holds_the_output_to_the_schema(client):
    fmt = {"type": "json_schema", "name": "ball", "schema": SCHEMA, "strict": True}
    reply = sdk(client).responses.create(
        model="tiny", input="Describe a ball.", text={"format": fmt}, temperature=0, max_output_tokens=120
    )
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.status == "completed"


def test_tool_types_the_server_cannot_run_are_accepted_and_not_offered(client):
    plain = sdk(client).responses.create(model="tiny", input="Hi", max_output_tokens=1)
    hosted = sdk(client).responses.create(model="tiny", input="Hi", max_output_tokens=1, tools=HOSTED)
    assert hosted.usage.input_tokens == plain.usage.input_tokens  # a model without tool calling: no 400


def test_a_function_call_round_trip(tool_client, tool_engine, scripted):
    scripted["text"] += ["\nhmm</th", "ink>Let me check. ", CALL[:20], CALL[20:]]  # the prompt opened <think>
    api = sdk(tool_client)
    first = api.responses.create(model="tool-tiny", input="weather in Paris?", tools=[WEATHER])
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    assert first.output[0].content[0].text == "\nhmm" and first.output_text == "Let me check. "
    call = first.output[2]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})

    scripted["text"][:] = ["\nok</think>It is sunny."]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    resent = [item.model_dump(exclude_none=True) for item in first.output]
    by_items = api.responses.create(
        model="tool-tiny", input=[{"role": "user", "content": "weather in Paris?"}, *resent, result], tools=[WEATHER]
    )
    by_id = api.responses.create(model="tool-tiny", previous_response_id=first.id, input=[result], tools=[WEATHER])
    assert by_items.output_text == by_id.output_text == "It is sunny."
    prompt = tool_engine.loaded.tokenizer.decode(scripted["prompts"][-1])
    assert scripted["prompts"][-1] == scripted["prompts"][-2]  # the stored history renders as the resent items
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>sunny, 21C</tool_response>" in prompt


@pytest.mark.parametrize("summary", [False, True])
def test_function_calls_and_reasoning_stream_as_events(tool_client, scripted, summary):
    scripted["text"] += ["\nhm", "m</think>", CALL]
    reasoning = {"effort": "high", "summary": "auto"} if summary else None
    with sdk(tool_client).responses.stream(
        model="tool-tiny", input="weather?", tools=[WEATHER], **({"reasoning": reasoning} if reasoning else {})
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    kind = "reasoning_summary_text" if summary else "reasoning_text"
    assert "".join(e.delta for e in events if e.type == f"response.{kind}.delta") == "\nhmm"
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert kinds[-1] == "response.completed"
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    parts = final.output[0].summary if summary else final.output[0].content
    assert parts[0].text == "\nhmm"


def test_parse_maps_items_to_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    parsed = rs.parse(
        {"instructions": "Sys.", "input": items, "max_output_tokens": 5, "reasoning": {"effort": "none"}}, []
    )
    assert parsed.chat["messages"] == [
        {"role": "system", "content": "Sys.\n\nBe brief."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Sure.",
            "reasoning_content": "think",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    assert parsed.chat["max_tokens"] == 5 and parsed.chat["chat_template_kwargs"] == {"enable_thinking": False}


# --- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 422, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
        ({"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, 422, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, 422, "text.format"),
        ({"input": "hi", "temperature": 9}, 422, "temperature"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(client, body, status, param):
    reply = client.post("/v1/responses", json={"model": "tiny", **body})
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_fields_about_a_hosted_service_are_accepted(client):
    extra = {"metadata": {"k": "v"}, "user": "u", "prompt_cache_key": "k", "service_tier": "auto", "include": []}
    extra |= {"truncation": "auto", "safety_identifier": "s", "store": False, "parallel_tool_calls": False}
    reply = sdk(client).responses.create(model="tiny", input="Hi", max_output_tokens=1, **extra)
    assert reply.metadata == {"k": "v"} and reply.status == "incomplete"


def test_a_codex_shaped_request_streams_named_events(tool_client, scripted):
    """The fields and items Codex CLI sends (written here from its request shape), over the raw wire."""
    scripted["text"] += ["\nplan</think>", CALL]
    body = {
        "model": "tool-tiny",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: none"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        ],
        "tools": [WEATHER, {"type": "local_shell"}, {"type": "web_search"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-session",
        "text": {"verbosity": "low"},
        "client_metadata": {"x": "y"},
    }
    with tool_client.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        text = reply.read().decode()
    frames = [f for f in text.split("\n\n") if f.strip() and not f.startswith(":")]
    for frame in frames:
        head, data = frame.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == head[7:]
    kinds = [f.split("\n", 1)[0][7:] for f in frames]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.reasoning_summary_text.delta" in kinds and "response.function_call_arguments.done" in kinds
