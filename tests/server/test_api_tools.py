"""Tool calling over the OpenAI API (issue 13, item 1): tools reach the chat template, calls are
parsed by mlx-lm's parser for the model and returned as `tool_calls` (streamed as deltas), a model
without tool support gets a 400, and no request field is dropped silently.

A random-weight model never writes a valid call, so the parsing path is tested on given text: as a
unit (formats/output.py, formats/tool_calls.py) and end to end with a scripted engine that sends that text
as its deltas, through the official `openai` client.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_hardening_wire import make_engine
from toolmodel import build_tool_model

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.request import Finished, TextDelta, Usage
from mlx_kvserve.errors import InvalidRequestError, ValidationError
from mlx_kvserve.formats import tool_calls as tl
from mlx_kvserve.formats.output import CONTENT, ChatOutput, MarkerSplitter, collect
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.openai import parse as oa
from mlx_kvserve.server.openai.tools import call_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
USER = [{"role": "user", "content": "weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _loaded(folder, name: str = "tool-tiny") -> LoadedModel:
    model, tokenizer = load(str(folder))
    return LoadedModel(name, folder, model, tokenizer, json.loads((folder / "config.json").read_text()), 2048)


@pytest.fixture(scope="module")
def tool_loaded(tmp_path_factory) -> LoadedModel:
    return _loaded(build_tool_model(tmp_path_factory.mktemp("toolmodel") / "tool-tiny"))


@pytest.fixture(scope="module")
def tool_engine(tool_loaded, tmp_path_factory):
    return make_engine(tool_loaded, tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def tool_client(tool_engine):
    with TestClient(create_app(tool_engine, ApiKeys("", ""))) as client:
        yield client


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client, max_retries=0)


def split(tokenizer, text: str, spec: tl.ToolSpec | None, step: int = 0, prompt=(1,)):
    """Segments of `text` fed whole (step 0) or `step` characters at a time."""
    out = ChatOutput(tokenizer, list(prompt), spec)
    pieces = [text] if not step else [text[i : i + step] for i in range(0, len(text), step)]
    segments = [seg for piece in pieces for seg in out.feed(piece)] + out.finish()
    return collect(segments), out


# --- the parsing path, on given text ------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 3, 7])
def test_calls_are_parsed_by_mlx_lms_parser_whatever_the_delta_boundaries(tool_loaded, step):
    spec = tl.ToolSpec([WEATHER])
    (content, reasoning, calls), out = split(tool_loaded.tokenizer, "Sure. " + CALL + CALL2 + " ok", spec, step)
    assert content == "Sure.  ok" and reasoning == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert out.num_calls == 2


def test_text_that_only_looks_like_a_marker_stays_content(tool_loaded):
    (content, _, calls), _ = split(tool_loaded.tokenizer, "a < b <tool and <tool_cal", tl.ToolSpec([WEATHER]), 1)
    assert content == "a < b <tool and <tool_cal" and calls == []


def test_an_unreadable_or_cut_call_is_returned_as_text_not_dropped(tool_loaded):
    spec = tl.ToolSpec([WEATHER])
    bad = "<tool_call>{not json}</tool_call>"
    (content, _, calls), _ = split(tool_loaded.tokenizer, "x" + bad, spec, 2)
    assert content == "x" + bad and calls == []
    cut = '<tool_call>{"name": "get_weather", "argu'
    (content, _, calls), _ = split(tool_loaded.tokenizer, cut, spec, 4)
    assert content == cut and calls == []


def test_parallel_tool_calls_false_keeps_the_first_call(tool_loaded):
    (_, _, calls), out = split(tool_loaded.tokenizer, CALL + CALL2, tl.ToolSpec([WEATHER], parallel=False), 5)
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris"] and out.num_calls == 1


def test_tool_choice_none_returns_the_text_as_written(tool_loaded):
    (content, _, calls), _ = split(tool_loaded.tokenizer, CALL, tl.ToolSpec([WEATHER], choice="none"))
    assert content == CALL and calls == []


def test_the_splitter_holds_back_only_what_may_be_a_marker():
    splitter = MarkerSplitter({"tool": ("<tc>", "</tc>")})
    assert splitter.feed("ab<t") == [(CONTENT, "ab")]
    assert splitter.feed("x") == [(CONTENT, "<tx")]
    assert splitter.feed("<tc>{}") == []
    assert splitter.feed("</tc>z") == [("tool", "{}"), (CONTENT, "z")]


# --- request fields --------------------------------------------------------------------------------------

DEFAULTS = oa.Defaults(max_tokens=16, temperature=0.0, top_p=1.0)


def parse(**fields):
    return oa.parse_request({"messages": USER, **fields}, "chat", DEFAULTS)


def test_required_named_and_strict_choices_are_parsed():
    assert parse(tools=[WEATHER], tool_choice="required").tools == tl.ToolSpec([WEATHER], "required")
    named = parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tools == tl.ToolSpec([WEATHER], "required", name="get_weather")
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert parse(tools=[strict, WEATHER | {"function": {"name": "other"}}]).tools.strict_names == {"get_weather"}


def test_a_named_choice_must_name_an_offered_tool():
    with pytest.raises(InvalidRequestError, match="not in 'tools'") as err:
        parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.param == "tool_choice"


def test_required_calls_and_a_response_format_contradict():
    req = parse(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(InvalidRequestError, match="response_format"):
        call_grammar(req.tools, req.json_schema)


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": {"a": 1}},
        {"tools": [{"type": "retrieval"}]},
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"tools": [WEATHER], "tool_choice": {"type": "function"}},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 3}}},
        {"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}]},
        {"tools": [WEATHER], "parallel_tool_calls": "yes"},
        {"messages": USER + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
    ],
)
def test_malformed_tool_fields_are_422(fields):
    with pytest.raises(ValidationError):
        parse(**fields)


def test_tool_fields_are_parsed():
    req = parse(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False)
    assert req.tools == tl.ToolSpec([WEATHER], "none", False)
    assert parse().tools is None and parse(tools=[]).tools is None
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    messages = parse(messages=history).messages
    assert messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}  # an object for templates
    assert messages[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "field, value",
    [
        ("echo", True),
        ("best_of", 2),
        ("functions", [{"name": "f"}]),
    ],
)
def test_fields_not_served_are_a_400_naming_them(field, value):
    with pytest.raises(InvalidRequestError) as err:
        parse(**{field: value})
    assert err.value.param == field and field in err.value.message


def test_fields_at_their_neutral_value_are_accepted():
    parse(logprobs=False, response_format={"type": "text"}, best_of=1, echo=False, user="me")


# --- end to end, through the openai client -------------------------------------------------------------


def test_tools_reach_the_chat_template(tool_client, tool_engine):
    client = sdk(tool_client)
    plain = client.chat.completions.create(model="tool-tiny", messages=USER, max_tokens=1)
    tooled = client.chat.completions.create(model="tool-tiny", messages=USER, tools=[WEATHER], max_tokens=1)
    expected = tool_engine.chat_tokens(USER, tools=[WEATHER])
    assert "get_weather" in tool_engine.loaded.tokenizer.decode(expected)
    assert tooled.usage.prompt_tokens == len(expected) > plain.usage.prompt_tokens


def test_a_tool_round_trip_renders_through_the_template(tool_client, tool_engine):
    history = USER + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    reply = sdk(tool_client).chat.completions.create(model="tool-tiny", messages=history, tools=[WEATHER], max_tokens=1)
    rendered = tool_engine.loaded.tokenizer.decode(tool_engine.chat_tokens(oa.parse_messages(history), tools=[WEATHER]))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>sunny, 21C</tool_response>" in rendered
    assert reply.usage.prompt_tokens == len(tool_engine.chat_tokens(oa.parse_messages(history), tools=[WEATHER]))


def test_a_model_without_tool_support_gets_a_400(tiny_model_dir, tmp_path):
    engine = make_engine(_loaded(tiny_model_dir), tmp_path)
    assert not engine.loaded.tokenizer.has_tool_calling  # plain ChatML, like SmolLM2's template
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        with pytest.raises(openai.BadRequestError) as err:
            sdk(client).chat.completions.create(model="tool-tiny", messages=USER, tools=[WEATHER], max_tokens=1)
    assert err.value.code == "tools_not_supported" and "tool calling" in str(err.value)


@pytest.fixture
def scripted(tool_engine, monkeypatch):
    """The engine answers every request with the deltas in `script` (a list) and "stop"."""
    script: list[str] = []

    def submit(req):
        def run():
            for text in script:
                req.emit(TextDelta(text, 1))
            req.emit(Finished("stop", Usage(len(req.prompt_tokens), len(script)), 0.01))

        threading.Thread(target=run).start()

    monkeypatch.setattr(tool_engine, "submit", submit)
    return script


def test_tool_calls_come_back_with_ids_and_finish_reason(tool_client, scripted):
    scripted += ["\nhmm</th", "ink>Let me check. ", CALL[:20], CALL[20:], CALL2]  # the prompt opened <think>
    reply = sdk(tool_client).chat.completions.create(model="tool-tiny", messages=USER, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    assert choice.message.model_extra["reasoning_content"] == "\nhmm"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)


def test_tool_calls_stream_as_deltas(tool_client, scripted):
    scripted += ["Checking", CALL[:9], CALL[9:], " and", CALL2]
    stream = sdk(tool_client).chat.completions.create(
        model="tool-tiny", messages=USER, tools=[WEATHER], stream=True, extra_body=NO_THINKING
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking and"
    assert [(d.index, d.function.name, json.loads(d.function.arguments)["city"]) for d in deltas] == [
        (0, "get_weather", "Paris"),
        (1, "get_weather", "Oslo"),
    ]
    assert all(d.id.startswith("call_") for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_a_call_shaped_reply_is_plain_content(tool_client, scripted):
    scripted += [CALL]
    reply = sdk(tool_client).chat.completions.create(model="tool-tiny", messages=USER, extra_body=NO_THINKING)
    assert reply.choices[0].message.content == CALL and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "inner, arguments",
    [
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', {"a": 1}),  # arguments written as JSON text
        ('{"name": "f"}', {}),
        ('{"name": "f", "arguments": "not json"}', None),
        ('{"name": "f", "arguments": [1, 2]}', None),
        ('{"arguments": {}}', None),
        ("[1]", None),
    ],
)
def test_parsed_arguments_are_always_a_json_object(tool_loaded, inner, arguments):
    calls = tl.parse_tool_call(tool_loaded.tokenizer, inner, [WEATHER])
    if arguments is None:
        assert calls is None
    else:
        assert [json.loads(c.arguments) for c in calls] == [arguments]


@pytest.mark.slow
def test_the_default_model_offers_tools_in_json_tool_calls(smollm_dir):
    """SmolLM2's own template has no tools; the default model gets one that has (models/default_template.py)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(smollm_dir)
    assert tokenizer.has_tool_calling and not tokenizer.has_thinking
    assert tl.format_name(tokenizer) == tl.JSON_TOOLS
    tl.check_support(tokenizer, tl.ToolSpec([WEATHER]))  # no 400
    inner = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert [(c.name, json.loads(c.arguments)) for c in tl.parse_tool_call(tokenizer, inner, [WEATHER])] == [
        ("get_weather", {"city": "Paris"})
    ]
