"""Anthropic `context_management` tool-use clearing (`clear_tool_uses_20250919`) as Anthropic documents it, and
`redacted_thinking` blocks in the history, accepted and left out of the prompt (issue 24)."""

from __future__ import annotations

import pytest
from test_api_agent_clients import post_messages
from test_api_anthropic import plain_client, plain_engine  # noqa: F401  (fixtures)
from test_api_tools import _loaded, scripted, tool_client, tool_engine, tool_loaded  # noqa: F401  (fixtures)

from mlx_kvserve.errors import KVServeError
from mlx_kvserve.server.anthropic import parse as an
from mlx_kvserve.server.anthropic.context import PLACEHOLDER, PromptSize

BIG, SMALL = PromptSize(200_000, len), PromptSize(1_000, len)  # len: a character counts as a token


def tool_turns(names: list[str]) -> list[dict]:
    """A conversation with one tool use per assistant turn, named `names` in order, each answered."""
    messages: list[dict] = [{"role": "user", "content": "start"}]
    for i, name in enumerate(names):
        use = {"type": "tool_use", "id": f"call_{i}", "name": name, "input": {"path": f"file{i}"}}
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"a{i}"}, use]})
        result = {"type": "tool_result", "tool_use_id": f"call_{i}", "content": f"result {i} " * 10}
        messages.append({"role": "user", "content": [result]})
    return messages


def cleared(edit: dict, names: list[str], size: PromptSize | None = BIG) -> tuple[list[int], list[int]]:
    """Which tool uses had their result cleared, and which their input, under `edit`."""
    body = {"max_tokens": 5, "messages": tool_turns(names), "context_management": {"edits": [edit]}}
    messages = an.to_openai(body, size=size)["messages"]
    results = [int(m["tool_call_id"][5:]) for m in messages if m["role"] == "tool" and m["content"] == PLACEHOLDER]
    calls = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    inputs = [int(c["id"][5:]) for c in calls if c["function"]["arguments"] == {}]
    return results, inputs


EDIT = {"type": "clear_tool_uses_20250919"}


@pytest.mark.parametrize(
    "edit, size, results, inputs",
    [
        (EDIT, BIG, [0, 1], []),  # defaults: past 100k input tokens, all but the latest 3 results
        (EDIT, SMALL, [], []),  # under the trigger: nothing
        (EDIT, None, [], []),  # no size to measure with (the router's estimate): not reached
        (EDIT | {"keep": {"type": "tool_uses", "value": 1}}, BIG, [0, 1, 2, 3], []),
        (
            EDIT | {"keep": {"type": "tool_uses", "value": 0}, "clear_tool_inputs": True},
            BIG,
            [0, 1, 2, 3, 4],
            [0, 1, 2, 3, 4],
        ),
        (EDIT | {"trigger": {"type": "tool_uses", "value": 4}}, None, [0, 1], []),  # 5 uses > 4
        (EDIT | {"trigger": {"type": "tool_uses", "value": 5}}, None, [], []),
        (EDIT | {"trigger": {"type": "input_tokens", "value": 999}}, SMALL, [0, 1], []),
        (EDIT | {"clear_at_least": {"type": "input_tokens", "value": 10_000}}, BIG, [], []),  # too little to clear
        (EDIT | {"clear_at_least": {"type": "input_tokens", "value": 100}}, BIG, [0, 1], []),  # 2 x 90 characters
    ],
)
def test_clear_tool_uses_thresholds_and_keep(edit, size, results, inputs):
    assert cleared(edit, ["read"] * 5, size) == (results, inputs)


def test_excluded_tools_keep_their_results_and_inputs_may_be_cleared_by_name():
    names = ["read", "memory", "bash", "read", "memory", "bash"]
    keep = {"type": "tool_uses", "value": 2}  # counts every use, excluded ones too: the last two (4, 5) stay
    edit = EDIT | {"keep": keep, "exclude_tools": ["memory"], "clear_tool_inputs": ["bash"]}
    assert cleared(edit, names) == ([0, 2, 3], [2])


@pytest.mark.parametrize(
    "edit, words",
    [
        (EDIT | {"keep": {"type": "input_tokens", "value": 3}}, "keep"),
        (EDIT | {"trigger": {"type": "tool_uses", "value": -1}}, "trigger"),
        (EDIT | {"exclude_tools": "memory"}, "exclude_tools"),
        (EDIT | {"clear_tool_inputs": "yes"}, "clear_tool_inputs"),
        (EDIT | {"placeholder": "gone"}, "placeholder"),
    ],
)
def test_a_malformed_clear_tool_uses_edit_names_the_field(edit, words):
    body = {"max_tokens": 5, "messages": tool_turns(["read"] * 5), "context_management": {"edits": [edit]}}
    with pytest.raises(KVServeError) as caught:
        an.to_openai(body, size=BIG)
    assert words in caught.value.message and caught.value.param == "context_management"


def test_the_server_clears_once_the_rendered_prompt_passes_the_trigger(tool_client, scripted):  # noqa: F811
    def count(value: int) -> int:
        trigger = {"type": "input_tokens", "value": value}
        body = {"model": "tool-tiny", "messages": tool_turns(["get_weather"] * 5)}
        body["context_management"] = {"edits": [EDIT | {"trigger": trigger}]}
        reply = tool_client.post("/v1/messages/count_tokens", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["input_tokens"]

    whole, big = count(10**6), count(10)
    assert big < whole  # two 90-character results became PLACEHOLDER
    scripted.append("ok")
    body = {"model": "tool-tiny", "max_tokens": 4, "messages": tool_turns(["get_weather"] * 5)}
    reply = post_messages(tool_client, body | {"context_management": {"edits": [EDIT]}})
    assert reply.status_code == 200 and reply.json()["content"][0]["text"] == "ok"


REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"}


def test_redacted_thinking_is_accepted_and_not_rendered(plain_client, plain_engine):  # noqa: F811
    turn = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [REDACTED, {"type": "text", "text": "yo"}]},
    ]
    body = {"max_tokens": 4, "messages": [*turn, {"role": "user", "content": "and?"}]}
    assistant = an.to_openai(body)["messages"][1]
    assert assistant == {"role": "assistant", "content": "yo"}
    reply = post_messages(plain_client, body | {"model": "tiny"})
    assert reply.status_code == 200, reply.text
