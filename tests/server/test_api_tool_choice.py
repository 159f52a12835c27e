"""Forced and strict tool calls (issue 13, item 2): `tool_choice` "required" or a named function,
Anthropic's "any" / "tool", and `strict` tools are held to the model's call format and each tool's
schema by a grammar (engine/sampling/tool_grammar.py), so even a random-weight model returns arguments that
validate. The grammar itself is checked token by token with llguidance's matcher.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import jsonschema
import llguidance
import llguidance.hf
import pytest
from test_api_tools import USER, WEATHER, sdk, tool_client, tool_engine, tool_loaded  # noqa: F401  (fixtures)

from mlx_kvserve.engine.sampling import tool_grammar as tg

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a zone",
        "parameters": {
            "type": "object",
            "properties": {
                "tz": {"type": "string", "enum": ["UTC", "CET", "PST"]},
                "hours": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["tz", "hours"],
            "additionalProperties": False,
        },
    },
}
LAMP = {
    "type": "function",
    "function": {
        "name": "set_lamp",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "room": {"type": "string", "enum": ["hall", "kitchen"]}},
            "required": ["on", "room"],
            "additionalProperties": False,
        },
    },
}
BOUNDED = [TIME, LAMP]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}\n</tool_call>"


GOOD = call_text("get_time", {"tz": "UTC", "hours": 7})


@pytest.fixture(scope="module")
def matcher(tool_loaded):  # noqa: F811
    tokenizer = tool_loaded.tokenizer
    ll = llguidance.hf.from_tokenizer(tokenizer._tokenizer)

    def accepts(spec: tg.CallGrammar, text: str, prompt_text: str = "<|im_start|>assistant\n") -> bool:
        """Whether the grammar of `spec` takes `text` whole, as the reply to a prompt ending in `prompt_text`."""
        prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
        grammar = llguidance.LLMatcher.grammar_from_lark(tg.build(tokenizer, prompt, spec))
        assert llguidance.LLMatcher.validate_grammar(grammar, ll) == ""
        m = llguidance.LLMatcher(ll, grammar)
        return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    return accepts


# --- the grammar, token by token ---------------------------------------------------------------------------


def test_a_forced_call_takes_only_schema_valid_calls(matcher):
    forced = tg.CallGrammar((TIME, LAMP), forced=True)
    assert matcher(forced, GOOD)
    assert matcher(forced, call_text("set_lamp", {"on": True, "room": "hall"}))
    assert not matcher(forced, call_text("get_time", {"tz": "MSK", "hours": 7}))  # not in the enum
    assert not matcher(forced, call_text("get_time", {"tz": "UTC", "hours": 24}))  # over the maximum
    assert not matcher(forced, call_text("get_time", {"tz": "UTC"}))  # a required argument missing
    assert not matcher(forced, call_text("get_weather", {"city": "Paris"}))  # not offered
    assert not matcher(forced, "Sure! " + GOOD)  # no text before the call
    assert not matcher(forced, "")  # and no reply without one


def test_named_and_single_calls(matcher):
    named = tg.CallGrammar((TIME, LAMP), forced=True, name="set_lamp")
    assert not matcher(named, GOOD)
    assert matcher(named, call_text("set_lamp", {"on": False, "room": "kitchen"}))
    assert matcher(tg.CallGrammar((TIME,), forced=True), GOOD + "\n" + GOOD)
    assert not matcher(tg.CallGrammar((TIME,), forced=True, parallel=False), GOOD + "\n" + GOOD)


def test_a_thinking_model_may_reason_before_the_call(matcher):
    forced = tg.CallGrammar((TIME,), forced=True)
    assert matcher(forced, "let me see</think>\n\n" + GOOD, "<|im_start|>assistant\n<think>\n")  # opened by the prompt
    assert not matcher(forced, GOOD, "<|im_start|>assistant\n<think>\n")  # the open block must close first
    assert matcher(forced, "<think>hm</think>\n" + GOOD)  # the model opens one itself
    assert matcher(forced, GOOD)
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking turned off by the template
    assert matcher(forced, GOOD, closed) and not matcher(forced, "<think>x</think>" + GOOD, closed)


def test_strict_tools_under_auto_leave_text_free_and_hold_calls(matcher):
    strict = tg.CallGrammar((TIME, WEATHER), strict_names=frozenset({"get_time"}))
    assert matcher(strict, "It is sunny.")
    assert matcher(strict, "Checking. " + GOOD + " done")
    assert not matcher(strict, "Checking. " + call_text("get_time", {"tz": "UTC", "hours": "7"}))
    assert matcher(strict, call_text("get_weather", {"anything": [1, 2]}))  # not strict: any object
    assert not matcher(strict, call_text("get_weather", [1]))  # but still an object, and a known name
    assert not matcher(tg.CallGrammar((TIME,), parallel=False, strict_names=frozenset({"get_time"})), GOOD + GOOD)


def test_auto_with_a_response_format_is_an_answer_or_calls(matcher):
    spec = tg.CallGrammar((TIME,), answer_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
    assert matcher(spec, '{"n":3}') and matcher(spec, GOOD)
    assert not matcher(spec, "three") and not matcher(spec, '{"n":"3"}')


def test_a_format_without_a_grammar_is_refused_by_name():
    tokenizer = SimpleNamespace(tool_parser=SimpleNamespace(__module__="mlx_lm.tool_parsers.glm47"))
    with pytest.raises(tg.UnsupportedCallFormat, match="glm47"):
        tg.build(tokenizer, [], tg.CallGrammar((TIME,), forced=True))
    with pytest.raises(tg.UnsupportedCallFormat, match="none"):
        tg.check_format(SimpleNamespace(tool_parser=None))


# --- end to end on the random-weight model ----------------------------------------------------------------


def check_calls(calls, names=SCHEMAS) -> None:
    assert calls, "a forced choice must produce a call"
    for call in calls:
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_schema_valid_calls_from_a_random_model(tool_client, seed):  # noqa: F811
    reply = sdk(tool_client).chat.completions.create(
        model="tool-tiny",
        messages=USER,
        tools=BOUNDED,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=seed,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls([{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls])


def test_a_named_choice_streams_calls_of_that_function(tool_client):  # noqa: F811
    stream = sdk(tool_client).chat.completions.create(
        model="tool-tiny",
        messages=USER,
        tools=BOUNDED,
        tool_choice={"type": "function", "function": {"name": "set_lamp"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body=NO_THINKING,
    )
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and len(calls) == 1
    check_calls(list(calls.values()), names={"set_lamp"})


def test_auto_with_strict_tools_and_a_response_format(tool_client):  # noqa: F811
    """Under auto the model chooses; whichever it chose is valid: a JSON answer or a schema-valid call."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in BOUNDED]
    for seed in range(3):
        reply = sdk(tool_client).chat.completions.create(
            model="tool-tiny",
            messages=USER,
            tools=strict,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}},
            extra_body=NO_THINKING,
        )
        message = reply.choices[0].message
        if message.tool_calls:
            check_calls([{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls])
        else:
            jsonschema.validate(json.loads(message.content), answer)


def test_anthropic_any_and_tool_choices_give_valid_tool_use_blocks(tool_client):  # noqa: F811
    client = anthropic.Anthropic(api_key="none", base_url="http://testserver", http_client=tool_client, max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in BOUNDED]
    for choice, names in (({"type": "any"}, set(SCHEMAS)), ({"type": "tool", "name": "get_time"}, {"get_time"})):
        reply = client.messages.create(
            model="tool-tiny",
            messages=USER,
            tools=tools,
            tool_choice=choice | {"disable_parallel_tool_use": True},
            max_tokens=200,
            thinking={"type": "disabled"},
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and len(uses) == 1
        check_calls([{"name": u.name, "arguments": json.dumps(u.input)} for u in uses], names=names)


# --- the qwen3_coder format (Qwen3-Coder, Qwen3.5): parameters as XML, raw string values ----------------------


@pytest.fixture(scope="module")
def xml_loaded(tmp_path_factory):
    from test_api_tools import _loaded
    from toolmodel import XML_TOOL_TEMPLATE, build_tool_model

    folder = build_tool_model(tmp_path_factory.mktemp("xmltools") / "xml-tiny", template=XML_TOOL_TEMPLATE)
    return _loaded(folder, "xml-tiny")


def xml_call(name: str, arguments: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_the_xml_format_grammar_takes_what_its_parser_reads(xml_loaded):
    tokenizer = xml_loaded.tokenizer
    assert tg.format_name(tokenizer) == "qwen3_coder"
    ll = llguidance.hf.from_tokenizer(tokenizer._tokenizer)
    note = {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "n": {"type": "integer", "maximum": 9}},
                "required": ["text"],
            },
        },
    }
    spec = tg.CallGrammar((TIME, note), forced=True)

    def accepts(text: str) -> bool:
        grammar = llguidance.LLMatcher.grammar_from_lark(tg.build(tokenizer, [], spec))
        m = llguidance.LLMatcher(ll, grammar)
        return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    good = [
        ("get_time", {"tz": "CET", "hours": 5}),
        ("note", {"text": "two\nlines <b>"}),
        ("note", {"text": "x", "n": 3}),
    ]
    for name, args in good:
        assert accepts(xml_call(name, args)), (name, args)
        (parsed,) = [
            tokenizer.tool_parser(xml_call(name, args)[len("<tool_call>") : -len("</tool_call>")], [TIME, note])
        ]
        assert parsed == {"name": name, "arguments": args}  # what the grammar lets through reads back exactly
    assert not accepts(xml_call("get_time", {"tz": "MSK", "hours": 5}))
    assert not accepts(xml_call("get_time", {"hours": 5}))
    assert not accepts(xml_call("note", {"text": "x", "n": 12}))
    with pytest.raises(tg.UnsupportedCallFormat, match="pattern"):
        bad = {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"s": {"type": "string", "pattern": "^a$"}}}},
        }
        tg.build(tokenizer, [], tg.CallGrammar((bad,), forced=True))


def test_required_on_the_xml_format_gives_valid_calls_from_a_random_model(xml_loaded, tmp_path):
    from starlette.testclient import TestClient
    from test_hardening_wire import make_engine

    from mlx_kvserve.config import ApiKeys
    from mlx_kvserve.server.app import create_app

    engine = make_engine(xml_loaded, tmp_path)
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        for seed in range(3):
            reply = sdk(client).chat.completions.create(
                model="xml-tiny",
                messages=USER,
                tools=BOUNDED,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=200,
                temperature=1.0,
                seed=seed,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            check_calls(
                [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
            )
    engine.stop(0)


# --- forced calls exact (issue 24, item 4): open schemas closed, one call when named, nothing after ----------

# An open schema (no additionalProperties). `a` is bounded so a random model cannot spend max_tokens
# inside one string value, which any schema allows: what is tested is keys, calls and the end.
OPEN = {
    "type": "function",
    "function": {
        "name": "pair",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"type": "integer"}},
        },
    },
}
OPEN_KEYS = {"a", "b"}


def test_a_forced_call_closes_open_schemas_and_ends_after_the_calls(matcher):
    named = tg.CallGrammar((OPEN,), forced=True, name="pair")
    assert matcher(named, call_text("pair", {"a": "x", "b": 1}))
    assert not matcher(named, call_text("pair", {"a": "x", "zz": 1}))  # no key the schema does not name
    assert not matcher(named, call_text("pair", {"a": "x"}) + "\n" + call_text("pair", {"b": 2}))  # named: one call
    assert not matcher(named, call_text("pair", {"a": "x"}) + " trailing")  # nothing after the call
    assert not matcher(named, '<tool_call>\n{"name":"pair","arguments":{"a": "x"}}\n</tool_call>')  # no padding
    nested = {"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "integer"}}}}}
    deep = tg.CallGrammar(({"type": "function", "function": {"name": "pair", "parameters": nested}},), forced=True)
    assert matcher(deep, call_text("pair", {"o": {"k": 1}}))
    assert not matcher(deep, call_text("pair", {"o": {"k": 1, "z": 2}}))  # closed all the way down
    opened = {"type": "function", "function": {**OPEN["function"], "parameters": {"type": "object"}}}
    assert matcher(tg.CallGrammar((opened,), forced=True), call_text("pair", {"any": 1}))  # no properties: any object
    allowed = {**OPEN["function"]["parameters"], "additionalProperties": {"type": "integer"}}
    extra = tg.CallGrammar(({"type": "function", "function": {"name": "pair", "parameters": allowed}},), forced=True)
    assert matcher(extra, call_text("pair", {"a": "x", "zz": 1}))  # the schema allows more keys: kept
    required = tg.CallGrammar((OPEN,), forced=True)
    assert matcher(required, call_text("pair", {"a": "x"}) + "\n" + call_text("pair", {"b": 2}))  # parallel allowed


def check_open_calls(calls) -> None:
    for call in calls:
        assert call.name == "pair" and set(json.loads(call.arguments)) <= OPEN_KEYS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_choice_on_an_open_schema_is_one_closed_call(tool_client, seed):  # noqa: F811
    reply = sdk(tool_client).chat.completions.create(
        model="tool-tiny",
        messages=USER,
        tools=[OPEN, WEATHER],
        tool_choice={"type": "function", "function": {"name": "pair"}},
        parallel_tool_calls=True,
        max_tokens=400,
        temperature=1.0,
        seed=seed,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    check_open_calls([c.function for c in choice.message.tool_calls])
    assert reply.usage.completion_tokens < 200


@pytest.mark.parametrize("seed", [0, 1])
def test_required_without_parallel_on_an_open_schema_is_one_call(tool_client, seed):  # noqa: F811
    reply = sdk(tool_client).chat.completions.create(
        model="tool-tiny",
        messages=USER,
        tools=[OPEN],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=400,
        temperature=1.0,
        seed=seed,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    check_open_calls([c.function for c in choice.message.tool_calls])


def test_required_with_parallel_on_an_open_schema_is_calls_only(tool_client):  # noqa: F811
    reply = sdk(tool_client).chat.completions.create(
        model="tool-tiny",
        messages=USER,
        tools=[OPEN],
        tool_choice="required",
        max_tokens=400,
        temperature=1.0,
        seed=3,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls
    check_open_calls([c.function for c in choice.message.tool_calls])


def test_anthropic_tool_choice_on_an_open_schema_is_one_tool_use(tool_client):  # noqa: F811
    client = anthropic.Anthropic(api_key="none", base_url="http://testserver", http_client=tool_client, max_retries=0)
    tools = [{"name": "pair", "input_schema": OPEN["function"]["parameters"]}]
    for seed_text in ("weather in Paris?", "and in Oslo?"):
        reply = client.messages.create(
            model="tool-tiny",
            messages=[{"role": "user", "content": seed_text}],
            tools=tools,
            tool_choice={"type": "tool", "name": "pair"},
            max_tokens=400,
            extra_body={"temperature": 0.0},  # greedy: the call's length is the model's, the same every run
            thinking={"type": "disabled"},
        )
        assert reply.stop_reason == "tool_use"
        assert [b.type for b in reply.content] == ["tool_use"]
        assert reply.content[0].name == "pair" and set(reply.content[0].input) <= OPEN_KEYS
        assert reply.usage.output_tokens < 200
