"""The recorded agent session (issue 44): `agents.py record`'s scripted replies are Anthropic streams Claude Code
reads as text and one tool call, a session's main requests are replayed in order as sent (but for the reply's
size), and their chat form keeps every system block, system turn and tool result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from harness.agent_recorder import ANSWER, SCRIPT, scripted
from harness.agent_session import MAX_TOKENS, as_chat, recorded_session

from mlx_kvserve.launch.clients import CLIENTS

BASH = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}


def parse_stream(raw: bytes) -> dict:
    """The message an Anthropic stream builds: content blocks (tool inputs joined and parsed) and stop reason."""
    blocks, reason, names = [], None, []
    for chunk in raw.decode().strip().split("\n\n"):
        event_line, data_line = chunk.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        names.append(event_line.removeprefix("event: "))
        assert event["type"] == names[-1]
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"], partial=""))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[event["index"]]["text"] += delta["text"]
            else:
                blocks[event["index"]]["partial"] += delta["partial_json"]
        elif event["type"] == "message_delta":
            reason = event["delta"]["stop_reason"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial"])
        del block["partial"]
    return {"content": blocks, "stop_reason": reason}


def main_body(tool_results: int) -> dict:
    messages = [{"role": "user", "content": [{"type": "text", "text": "task"}]}]
    for i in range(tool_results):
        use = {"type": "tool_use", "id": f"t{i}", "name": "Bash", "input": {}}
        messages += [{"role": "assistant", "content": [use]}]
        messages += [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "out"}]}]
    return {"model": "m", "tools": [BASH], "messages": messages, "stream": True}


def test_the_script_answers_each_main_request_with_its_next_tool_call_and_lets_the_rest_through(tmp_path):
    answer = scripted(tmp_path)
    for step, (text, name, arguments) in enumerate(SCRIPT):
        kind, raw = answer("/v1/messages?beta=true", json.dumps(main_body(step)).encode())
        reply = parse_stream(raw)
        assert kind == "text/event-stream" and reply["stop_reason"] == "tool_use"
        said, call = reply["content"]
        assert said == {"type": "text", "text": text} and call["name"] == name
        want = {k: v.replace("{root}", str(tmp_path)) if isinstance(v, str) else v for k, v in arguments.items()}
        assert call["input"] == want and "{root}" not in json.dumps(call["input"])
    _, raw = answer("/v1/messages", json.dumps(main_body(len(SCRIPT))).encode())
    assert parse_stream(raw) == {"content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn"}
    title = {"model": "m", "messages": [{"role": "user", "content": "a title"}], "max_tokens": 32}
    assert answer("/v1/messages", json.dumps(title).encode()) is None  # a background call: to the server
    assert answer("/v1/messages/count_tokens", json.dumps(main_body(0)).encode()) is None
    assert answer("/v1/models", b"") is None


def test_a_recorded_session_replays_its_main_requests_in_order_and_their_chat_form_keeps_every_part(tmp_path):
    first = dict(main_body(0), max_tokens=32000, system=[{"type": "text", "text": "You are an agent."}])
    first["messages"].append({"role": "system", "content": "# Environment\ncwd: /repo"})
    second = json.loads(json.dumps(first))
    use = {"type": "tool_use", "id": "t0", "name": "Bash", "input": {"command": "ls"}}
    result = {"type": "tool_result", "tool_use_id": "t0", "content": [{"type": "text", "text": "README.md"}]}
    second["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "Listing."}, use]}]
    second["messages"] += [{"role": "user", "content": [result]}]
    background = {"model": "m", "messages": [{"role": "user", "content": "a title"}], "max_tokens": 32}
    for name, body in [("003", first), ("004", background), ("005", second)]:
        (tmp_path / f"{name}-POST_v1_messages.json").write_text(json.dumps(body))
    (tmp_path / "001-GET_health.json").write_bytes(b"")
    replay = recorded_session(tmp_path)
    assert [len(b["messages"]) for b in replay] == [2, 4]  # the background call left out, the order kept
    assert all(b["max_tokens"] == MAX_TOKENS and b["stream"] and b["temperature"] == 0.0 for b in replay)
    assert replay[1]["messages"] == second["messages"] and replay[1]["tools"] == [BASH]
    messages, tools = as_chat(replay[1])
    assert messages == [
        {"role": "system", "content": "You are an agent."},  # no billing line: the first block stays
        {"role": "user", "content": "task"},
        {"role": "system", "content": "# Environment\ncwd: /repo"},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"id": "t0", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
        ]},
        {"role": "tool", "tool_call_id": "t0", "content": "README.md"},
    ]  # fmt: skip
    assert tools == [{"type": "function", "function": {"name": "Bash", "description": "Run a command",
                                                       "parameters": BASH["input_schema"]}}]  # fmt: skip
    billed = dict(replay[0], system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, *first["system"]])
    assert as_chat(billed)[0][0]["content"] == "You are an agent."  # a chat client sends no billing line


def test_record_names_claude_codes_install_command_when_it_is_not_installed(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))
    args = [sys.executable, "scripts/agents.py", "record", "--out", str(tmp_path / "out")]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"Claude Code is not installed: {CLIENTS['claude'].install}" in proc.stdout
    assert not Path(tmp_path / "out").exists()
