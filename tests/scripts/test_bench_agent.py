"""The agent model's tool template mlx-lm reads tool calls from (scripts/harness/agent_model.py) and the streamed
reply the benches time (clients.py), without servers."""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

from harness import OURS, THEIRS, agent_model, clients


def test_mlx_lm_reads_json_tool_calls_from_the_template():
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    fake = SimpleNamespace(chat_template=agent_model.TOOL_TEMPLATE, get_vocab=dict)
    assert _infer_tool_parser(fake) == "json_tools"


def _stream(lines: list[str]):
    @contextmanager
    def fake(method, url, json, timeout):
        fake.body = json
        yield SimpleNamespace(raise_for_status=lambda: None, iter_lines=lambda: iter(lines))

    return fake


TOOLS = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {}}}}]


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
    reply = clients.stream_turn(server, [{"role": "user", "content": "hi"}], TOOLS, 4)
    assert reply.prompt_tokens == 120 and reply.cached_tokens == 96 and reply.first == "tool_calls"
    assert 0 <= reply.ttft_s < 1
    assert fake.body["model"] == "default" and fake.body["tools"] == TOOLS and fake.body["stream"]
    monkeypatch.setattr(clients.httpx, "stream", _stream(['data: {"choices": [], "usage": {"prompt_tokens": 5}}']))
    reply = clients.stream_turn(SimpleNamespace(name=THEIRS, url="http://x"), [], [], 4)
    assert reply.first == "none" and reply.cached_tokens is None and reply.prompt_tokens == 5
