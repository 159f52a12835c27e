"""The agent workload without servers (scripts/harness: agent_workload.py, clients.py): its tools and
instructions, the tool template mlx-lm reads tool calls from, and the streamed reply the benches time."""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

from harness import OURS, THEIRS, agent_workload, clients
from harness.agent_workload import agent_instructions, tool_schemas


def test_tool_schemas_are_function_tools_with_object_schemas():
    tools = tool_schemas()
    names = [t["function"]["name"] for t in tools]
    assert len(tools) == 20 and len(set(names)) == 20
    for tool in tools:
        schema = tool["function"]["parameters"]
        assert tool["type"] == "function" and schema["type"] == "object"
        assert set(schema["required"]) <= set(schema["properties"])
    assert [t["function"]["name"] for t in tool_schemas(3)] == names[:3]


def test_instructions_are_deterministic_about_the_asked_size_and_open_with_the_nonce():
    a = agent_instructions("a", 1000)
    assert a == agent_instructions("a", 1000) and a.startswith("Session a.\n")
    assert agent_instructions("b", 1000).split("\n", 1)[1] == a.split("\n", 1)[1]  # only the nonce differs
    assert 1000 <= len(a.split()) <= 1040
    assert "`run_tests`" in a and "the billing API" in a


def test_mlx_lm_reads_json_tool_calls_from_the_template():
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    fake = SimpleNamespace(chat_template=agent_workload.TOOL_TEMPLATE, get_vocab=dict)
    assert _infer_tool_parser(fake) == "json_tools"


def _stream(lines: list[str]):
    @contextmanager
    def fake(method, url, json, timeout):
        fake.body = json
        yield SimpleNamespace(raise_for_status=lambda: None, iter_lines=lambda: iter(lines))

    return fake


def test_stream_turn_times_the_first_delta_and_reads_usage(monkeypatch):
    usage = {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}}
    lines = [
        'data: {"choices": [{"delta": {"role": "assistant"}}]}',
        'data: {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}',
        'data: {"choices": [{"delta": {"content": "x"}}]}',
        f'data: {{"choices": [], "usage": {json.dumps(usage)}}}',
        "data: [DONE]",
    ]
    fake = _stream(lines)
    monkeypatch.setattr(clients.httpx, "stream", fake)
    server = SimpleNamespace(name=OURS, url="http://x")
    reply = clients.stream_turn(server, [{"role": "user", "content": "hi"}], tool_schemas(1), 4)
    assert reply.prompt_tokens == 120 and reply.cached_tokens == 96 and reply.first == "tool_calls"
    assert 0 <= reply.ttft_s < 1
    assert fake.body["model"] == "default" and fake.body["tools"] == tool_schemas(1) and fake.body["stream"]
    monkeypatch.setattr(clients.httpx, "stream", _stream(['data: {"choices": [], "usage": {"prompt_tokens": 5}}']))
    reply = clients.stream_turn(SimpleNamespace(name=THEIRS, url="http://x"), [], [], 4)
    assert reply.first == "none" and reply.cached_tokens is None and reply.prompt_tokens == 5
