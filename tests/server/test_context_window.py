"""The context window (issue 45): a prompt past it refused before any work in each API's own words
(through the official SDKs, on a real server whose context [model] context_length makes small), the
window on the model lists, and [server] context_overflow = "truncate" (system prompt, tools and newest
turns kept, whole older turns dropped, the count in a response header)."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest
from starlette.testclient import TestClient
from test_api_tools import WEATHER, _loaded, tool_loaded  # noqa: F401  (fixtures)

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.server import context_window as cw
from mlx_kvserve.server.app import create_app

CONTEXT = 96  # [model] context_length of the servers here
LONG = "apples and pears " * 40  # well past CONTEXT tokens


# --- pure parts ------------------------------------------------------------------------------------------


def test_window_and_the_error_in_each_api_s_words():
    assert cw.window(2048) == cw.Window(2048, 2047)  # one token left to generate
    assert cw.window(2048, 1000) == cw.Window(1000, 1000)  # [server] max_prompt_tokens binds
    assert cw.window(2048, 4096) == cw.Window(2048, 2047)
    err = cw.ContextLengthError(14888, cw.window(14000))
    assert (err.status_code, err.code, err.param, err.error_type) == (
        400,
        "context_length_exceeded",
        "messages",
        "invalid_request_error",
    )
    assert err.message == (
        "This model's maximum context length is 14000 tokens. However, your messages resulted in 14888 tokens. "
        "Please reduce the length of the messages."
    )
    assert err.anthropic_message() == "prompt is too long: 14888 tokens > 13999 maximum"
    assert err.responses_message().startswith(cw.RESPONSES_MESSAGE)
    text = cw.ContextLengthError(30, cw.window(20), "text")
    assert text.param == "prompt" and "your prompt resulted in 30 tokens" in text.message
    cw.check_prompt(2047, cw.window(2048))
    with pytest.raises(cw.ContextLengthError):
        cw.check_prompt(2048, cw.window(2048))


def test_window_fields_name_the_window_as_clients_read_it():
    assert cw.window_fields(4096, 0, 0, anthropic=False) == {
        "context_length": 4096,
        "max_model_len": 4096,
        "context_window": 4096,
    }
    assert cw.window_fields(4096, 1000, 0, anthropic=False)["context_length"] == 1000
    assert cw.window_fields(4096, 0, 0, anthropic=True) == {"max_input_tokens": 4096, "max_tokens": 4096}
    assert cw.window_fields(4096, 0, 512, anthropic=True) == {"max_input_tokens": 4096, "max_tokens": 512}
    assert cw.window_fields(0, 0, 0, anthropic=True) == {}  # not known: no field rather than a wrong one


def call(cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}


CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "u1"},  # 1
    {"role": "assistant", "content": "", "tool_calls": [call("a")]},
    {"role": "user", "content": "text before the result"},  # 3: between a call and its result
    {"role": "tool", "tool_call_id": "a", "content": "r"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "u2"},  # 6
    {"role": "assistant", "content": "a2"},
    {"role": "user", "content": "u3"},  # 8
]


def test_cut_points_never_split_a_call_from_its_result():
    assert cw.cut_points(CONVERSATION) == [1, 6, 8]
    assert cw.cut_points([{"role": "system", "content": "S"}]) == []


def fake_render(messages):
    """One token per character of content (enough to order the candidates)."""

    async def render(msgs):
        return [0] * sum(len(m["content"]) for m in msgs)

    return render


@pytest.mark.parametrize(("max_prompt", "kept_from", "dropped"), [(33, 6, 5), (7, 6, 5), (6, 8, 7), (3, 8, 7)])
def test_fit_turns_keeps_the_system_prompt_and_the_newest_turns(max_prompt, kept_from, dropped):
    # One token per character: 34 in all (past each max_prompt here), 7 from u2 on, 3 for S and u3.
    fitted = asyncio.run(cw.fit_turns(CONVERSATION, fake_render(CONVERSATION), max_prompt))
    assert fitted is not None
    assert fitted.messages == CONVERSATION[:1] + CONVERSATION[kept_from:]
    assert fitted.num_dropped == dropped and len(fitted.tokens) <= max_prompt


def test_fit_turns_gives_up_when_the_newest_turn_alone_does_not_fit():
    assert asyncio.run(cw.fit_turns(CONVERSATION, fake_render(CONVERSATION), 2)) is None
    one_turn = CONVERSATION[:2]
    assert asyncio.run(cw.fit_turns(one_turn, fake_render(one_turn), 1)) is None


# --- a real server on a small context, through the official SDKs -----------------------------------------


@pytest.fixture(scope="module")
def small(start_module_server, tiny_model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "config.toml"
    config.write_text(f"[model]\ncontext_length = {CONTEXT}\n")
    return start_module_server(tiny_model_dir, config=config)


def oa_client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=f"{server.base_url}/v1", max_retries=0)


def an_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="none", base_url=server.base_url, max_retries=0)


def prefill_tokens(server) -> int:
    return httpx.get(f"{server.base_url}/health").json()["batch"]["prefill_tokens"]


def test_context_errors_in_each_api_s_words_before_any_prefill(small):
    oa, an = oa_client(small), an_client(small)
    messages = [{"role": "user", "content": LONG}]
    n = an.messages.count_tokens(model="default", messages=messages).input_tokens
    assert n > CONTEXT
    started = time.monotonic()
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.create(model="default", messages=messages, max_tokens=32000, stream=True)  # as Claude Code
    assert info.value.response.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {n} tokens > {CONTEXT - 1} maximum",
        },
    }
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model="default", messages=messages)
    assert info.value.response.json()["error"] == {
        "message": f"This model's maximum context length is {CONTEXT} tokens. However, your messages resulted in "
        f"{n} tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model="default", prompt=LONG)
    error = info.value.response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, your prompt")
    with pytest.raises(openai.BadRequestError) as info:
        oa.responses.create(model="default", input=LONG)
    error = info.value.response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        "input",
        "invalid_request_error",
    )
    assert error["message"] == f"{cw.RESPONSES_MESSAGE} ({n} tokens; the context window is {CONTEXT} tokens)"
    with pytest.raises(openai.BadRequestError):  # streamed: refused before the stream starts
        oa.chat.completions.create(model="default", messages=messages, stream=True)
    assert time.monotonic() - started < 10  # five refusals, each without a prefill
    assert prefill_tokens(small) == 0
    # A prompt that fits is served, its max_tokens lowered to the room left (not refused).
    reply = oa.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=500)
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= CONTEXT
    assert prefill_tokens(small) > 0


def test_model_lists_carry_the_served_window(small):
    (card,) = oa_client(small).models.list().data
    assert (card.context_length, card.max_model_len, card.context_window) == (CONTEXT, CONTEXT, CONTEXT)
    one = oa_client(small).models.retrieve(card.id)
    assert one.context_length == CONTEXT
    (info,) = an_client(small).models.list().data
    assert (info.id, info.max_input_tokens, info.max_tokens) == (card.id, CONTEXT, CONTEXT)
    assert an_client(small).models.retrieve(card.id).max_input_tokens == CONTEXT


# --- context_overflow = "truncate" ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def truncating(tool_loaded, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("truncate")
    overrides = {
        "model": {"context_length": 600},
        "server": {"context_overflow": "truncate"},
        "ssd": {"enabled": False},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_KVSERVE_HOME", str(root / "home"))
        engine = Engine(tool_loaded, load_config(overrides=overrides))
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        yield engine, client


TURNS = [
    {"role": "user", "content": "first question " + "word " * 150},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call("c1"), "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "c1", "content": "sunny " * 20},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "second question " + "word " * 10},
    {"role": "assistant", "content": "An answer."},
    {"role": "user", "content": "the last question"},
]
SYSTEM = {"role": "system", "content": "You are terse."}


def test_truncate_keeps_system_tools_and_the_newest_turns(truncating):
    engine, client = truncating
    full = [SYSTEM, *TURNS]
    assert len(engine.chat_tokens(full, True, [WEATHER])) > 599  # the whole conversation is past the window
    kept = [SYSTEM, *TURNS[4:]]
    assert len(engine.chat_tokens(kept, True, [WEATHER])) <= 599  # from the second question on it fits
    body = {"model": "default", "messages": full, "tools": [WEATHER], "max_tokens": 2, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvserve-truncated-messages"] == "4"
    assert reply.json()["usage"]["prompt_tokens"] == len(engine.chat_tokens(kept, True, [WEATHER]))
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-kvserve-truncated-messages"] == "4"
        assert "[DONE]" in streamed.read().decode()
    # The same conversation as Anthropic's Messages and the Responses API: the same turns dropped.
    sdk = anthropic.Anthropic(api_key="none", base_url="http://testserver", http_client=client, max_retries=0)
    raw = sdk.messages.with_raw_response.create(
        model="default",
        system="You are terse.",
        messages=[
            {"role": "user", "content": "first question " + "word " * 150},
            {"role": "assistant", "content": "ok"},
        ]
        + [{"role": m["role"], "content": m["content"]} for m in TURNS[4:]],
        max_tokens=2,
    )
    assert raw.headers["x-kvserve-truncated-messages"] == "2"
    raw = client.post(
        "/v1/responses", json={"model": "default", "input": TURNS[:1] + TURNS[4:], "max_output_tokens": 2}
    )
    assert raw.status_code == 200, raw.text
    assert raw.headers["x-kvserve-truncated-messages"] == "1"


def test_truncate_refuses_when_the_last_turn_alone_is_past_the_window(truncating):
    _, client = truncating
    body = {"model": "default", "messages": [SYSTEM, *TURNS[:6], {"role": "user", "content": LONG}], "max_tokens": 2}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert "x-kvserve-truncated-messages" not in reply.headers
    fits = client.post(
        "/v1/chat/completions", json={"model": "default", "messages": [SYSTEM, TURNS[-1]], "max_tokens": 2}
    )
    assert fits.status_code == 200 and "x-kvserve-truncated-messages" not in fits.headers


def test_a_registered_model_s_card_carries_its_window():
    from mlx_kvserve.config import ServerConfig
    from mlx_kvserve.server.models_admin import CARD_FIELDS, _card

    row = {"id": "m", **dict.fromkeys(CARD_FIELDS), "context_length": 4096}
    server = ServerConfig(max_prompt_tokens=1000, max_completion_tokens=256)
    assert _card(row, 0, False, server)["context_length"] == 1000  # max_prompt_tokens binds
    assert _card(row, 0, True, server)["max_input_tokens"] == 1000 and _card(row, 0, True, server)["max_tokens"] == 256
    never_loaded = _card(row | {"context_length": None}, 0, False, ServerConfig())
    assert "context_length" not in never_loaded and never_loaded["id"] == "m"
