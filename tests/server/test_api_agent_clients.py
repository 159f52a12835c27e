"""Request shapes the agent clients send (issue 24), written field by field: Claude Code's Messages
requests (`context_management`, `output_config.effort`, adaptive `thinking`, mid-conversation system
messages, the billing line with a per-request nonce, 32000 `max_tokens`), Anthropic's model list, the
OpenAI chat fields about a hosted service, `reasoning_effort`, and keep-alives while a prompt prefills.
"""

from __future__ import annotations

import threading
import time

import anthropic
import openai
import pytest
from test_api_anthropic import SYSTEM, TOOL, USER, plain_client, plain_engine, sdk  # noqa: F401  (fixtures)
from test_api_tools import _loaded, scripted, tool_client, tool_engine, tool_loaded  # noqa: F401  (fixtures)

from mlx_kvserve.engine.request import Finished, TextDelta, Usage
from mlx_kvserve.errors import ValidationError
from mlx_kvserve.server import sse
from mlx_kvserve.server.anthropic import parse as an
from mlx_kvserve.server.messages import merge_system_turns
from mlx_kvserve.server.openai import parse as oa

OFF = {"enable_thinking": False}
BILLING = "x-anthropic-billing-header: cc_version=2.1.9.a1b; cc_entrypoint=cli; cch={};"
CLAUDE_SYSTEM = "You are Claude Code, an interactive CLI tool. Use the tools to help the user. " * 14


def claude_code_body(nonce: str = "0f3a1", **fields) -> dict:
    """A Messages body as Claude Code 2.1 sends it for a model name it does not know."""
    return {
        "model": "tool-tiny",
        "max_tokens": 32000,  # always, whatever the model's context
        "system": [
            {"type": "text", "text": BILLING.format(nonce)},
            {"type": "text", "text": CLAUDE_SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in this folder?"}]},
            {"role": "system", "content": "The user switched to plan mode."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look first", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": [TOOL],
        "metadata": {"user_id": "user_abc_account_def_session_123"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": False,
    } | fields


def post_messages(client, body: dict):
    return client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})


# --- Claude Code's request, whole -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_claude_code_request_is_served(tool_client, scripted, stream):  # noqa: F811
    scripted += ["plan</think>", "Here it is."]
    reply = post_messages(tool_client, claude_code_body(stream=stream))
    assert reply.status_code == 200, reply.text
    if stream:
        assert "event: content_block_start" in reply.text and '"thinking_delta"' in reply.text
        assert "Here it is." in reply.text
    else:
        assert [b["type"] for b in reply.json()["content"]] == ["thinking", "text"]  # adaptive: thinking shown
        assert reply.json()["content"][1]["text"] == "Here it is."


def test_claude_codes_fields_reach_the_template(tool_engine):  # noqa: F811
    out = an.to_openai(claude_code_body())
    assert out["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "high"}
    assert [m["role"] for m in out["messages"]] == ["system", "user", "system", "assistant", "user"]
    assert out["messages"][0]["content"] == CLAUDE_SYSTEM  # the billing line is gone
    assert out["messages"][3]["reasoning_content"] == "look first"  # keep: all


SAFEGUARDS = [{"type": "dangerous_tool_use", "classifier_context": "The user asked to tidy the folder."}]


def test_auto_modes_safeguards_and_thinking_display_are_accepted(tool_engine):  # noqa: F811
    """Interactive Claude Code's auto mode asks Anthropic's hosted classifier to review tool calls
    (`safeguards`) and says how to show thinking (`thinking.display`): neither changes the prompt here."""
    plain = an.to_openai(claude_code_body())
    fields = {"safeguards": SAFEGUARDS, "thinking": {"type": "adaptive", "display": "summarized"}}
    assert an.to_openai(claude_code_body(**fields)) == plain
    for bad in (
        {"safeguards": "on"},
        {"safeguards": [{"classifier_context": "x"}]},
        {"thinking": {"type": "adaptive", "display": 1}},
    ):
        with pytest.raises(ValidationError) as err:
            an.to_openai(claude_code_body(**bad))
        assert err.value.status_code == 422 and err.value.param in ("safeguards", "thinking")


# --- thinking: Anthropic's semantics ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_no_thinking_field_means_no_thinking(tool_client, tool_engine, scripted, stream):  # noqa: F811
    scripted += ["<think>plan</think>", "Hello"]  # a model that thinks although asked not to
    body = {"model": "tool-tiny", "max_tokens": 50, "messages": USER, "stream": stream}
    reply = post_messages(tool_client, body)
    assert reply.status_code == 200
    if stream:
        assert '"thinking' not in reply.text and '"text_delta"' in reply.text
    else:
        assert reply.json()["content"] == [{"type": "text", "text": "Hello"}]
    counted = tool_client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert counted == len(tool_engine.chat_tokens(USER, template_kwargs=OFF))  # the template was asked not to


@pytest.mark.parametrize(
    "thinking, effort, kwargs",
    [
        (None, None, OFF),
        ({"type": "disabled"}, "high", {"enable_thinking": False, "reasoning_effort": "high"}),
        ({"type": "adaptive"}, "max", {"enable_thinking": True, "reasoning_effort": "high"}),
        ({"type": "enabled", "budget_tokens": 2048}, "low", {"enable_thinking": True, "reasoning_effort": "low"}),
        ({"type": "adaptive"}, "medium", {"enable_thinking": True, "reasoning_effort": "medium"}),
        ({"type": "adaptive"}, "ultra", {"enable_thinking": True}),  # a level unknown here: a hint, not a 400
    ],
)
def test_thinking_and_effort_map_to_the_template(thinking, effort, kwargs):
    body = {"max_tokens": 5, "messages": USER, "output_config": {"effort": effort}}
    if thinking is not None:
        body["thinking"] = thinking
    assert an.to_openai(body)["chat_template_kwargs"] == kwargs


# --- context_management -----------------------------------------------------------------------------------


def _turns(n: int) -> list[dict]:
    messages = []
    for i in range(n):
        messages.append({"role": "user", "content": f"q{i}"})
        thought = {"type": "thinking", "thinking": f"t{i}", "signature": ""}
        messages.append({"role": "assistant", "content": [thought, {"type": "text", "text": f"a{i}"}]})
    return messages + [{"role": "user", "content": "last"}]


@pytest.mark.parametrize(
    "edit, kept",
    [
        ({"type": "clear_thinking_20251015", "keep": "all"}, ["t0", "t1", "t2"]),
        ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}, ["t1", "t2"]),
        ({"type": "clear_thinking_20251015"}, ["t2"]),  # Anthropic's default: the latest turn
        ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 9}}, ["t0", "t1", "t2"]),
    ],
)
def test_clear_thinking_drops_earlier_thinking(edit, kept):
    body = {"max_tokens": 5, "messages": _turns(3), "context_management": {"edits": [edit]}}
    messages = an.to_openai(body)["messages"]
    assert [m["reasoning_content"] for m in messages if "reasoning_content" in m] == kept
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["a0", "a1", "a2"]


@pytest.mark.parametrize(
    "context_management, words",
    [
        ({"edits": [{"type": "compact_20260112"}]}, "'compact_20260112'"),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]}, "keep"),
        ({"edits": "all"}, "edits"),
    ],
)
def test_a_context_management_edit_not_applied_here_is_a_400(plain_client, context_management, words):  # noqa: F811
    body = {"model": "tiny", "max_tokens": 4, "messages": USER, "context_management": context_management}
    reply = post_messages(plain_client, body)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]
    assert reply.json()["error"]["type"] == "invalid_request_error"


# --- system messages in the conversation -------------------------------------------------------------------

MID_SYSTEM = [USER[0], {"role": "system", "content": "Be brief."}, {"role": "user", "content": "and Oslo?"}]


def test_a_system_message_mid_conversation_is_a_system_turn(tool_client, tool_engine):  # noqa: F811
    body = {"model": "tool-tiny", "messages": MID_SYSTEM, "thinking": {"type": "disabled"}}
    counted = tool_client.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    tokens = tool_engine.chat_tokens(MID_SYSTEM, template_kwargs=OFF)
    assert "<|im_start|>system\nBe brief." in tool_engine.loaded.tokenizer.decode(tokens)
    assert counted.json()["input_tokens"] == len(tokens)


def test_a_template_without_later_system_turns_gets_them_merged(tool_client, tool_engine, monkeypatch):  # noqa: F811
    render = tool_engine.chat_tokens

    def strict(messages, *args, **kwargs):  # as Qwen's templates: "System message must be at the beginning."
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("System message must be at the beginning.")
        return render(messages, *args, **kwargs)

    monkeypatch.setattr(tool_engine, "chat_tokens", strict)
    body = {"model": "tool-tiny", "messages": MID_SYSTEM, "thinking": {"type": "disabled"}}
    counted = tool_client.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    merged = [USER[0], {"role": "user", "content": "Be brief.\n\nand Oslo?"}]
    assert counted.json()["input_tokens"] == len(render(merged, template_kwargs=OFF))


def test_merge_system_turns():
    lead = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert merge_system_turns(lead) is lead
    trailing = [*lead, {"role": "assistant", "content": "a"}, {"role": "system", "content": "late"}]
    assert merge_system_turns(trailing) == [lead[0], {"role": "user", "content": "u\n\nlate"}, trailing[2]]
    alone = [{"role": "assistant", "content": "a"}, {"role": "system", "content": "x"}]
    assert merge_system_turns(alone) == [alone[0], {"role": "user", "content": "x"}]


# --- the billing line -------------------------------------------------------------------------------------


def test_a_billing_line_that_changes_every_request_still_caches(plain_client, plain_engine):  # noqa: F811
    def ask(nonce: str) -> dict:
        system = [{"type": "text", "text": BILLING.format(nonce)}, {"type": "text", "text": CLAUDE_SYSTEM}]
        body = {"model": "tiny", "max_tokens": 1, "system": system, "messages": USER, "temperature": 0}
        reply = post_messages(plain_client, body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]

    first, second = ask("a81f0"), ask("77c2e")
    prompt = first["input_tokens"] + first["cache_read_input_tokens"]
    assert prompt == len(plain_engine.chat_tokens([{"role": "system", "content": CLAUDE_SYSTEM}, *USER]))
    assert second["cache_read_input_tokens"] >= 0.95 * prompt


def test_the_billing_line_may_share_its_block_with_the_prompt():
    system = [{"type": "text", "text": BILLING.format("1") + "\nYou are terse."}]
    assert an.to_openai({"max_tokens": 1, "system": system, "messages": USER})["messages"][0]["content"] == (
        "You are terse."
    )
    kept = [{"type": "text", "text": "You are terse. " + BILLING.format("1")}]  # not first: left alone
    assert (
        an.to_openai({"max_tokens": 1, "system": kept, "messages": USER})["messages"][0]["content"] == (kept[0]["text"])
    )


# --- accepted fields and max_tokens -----------------------------------------------------------------------


def test_anthropic_service_tier_and_metadata_are_accepted(plain_client):  # noqa: F811
    reply = sdk(plain_client).messages.create(
        model="tiny", max_tokens=1, messages=USER, service_tier="auto", metadata={"user_id": "u1"}
    )
    assert reply.usage.output_tokens <= 1


@pytest.fixture
def budgets(tool_engine, monkeypatch):  # noqa: F811
    """The engine answers "ok" at once; the list holds each request's max_tokens as submitted."""
    seen: list[int] = []

    def submit(req):
        seen.append(req.params.max_tokens)
        req.emit(TextDelta("ok", 1))
        req.emit(Finished("stop", Usage(len(req.prompt_tokens), 1), 0.01))

    monkeypatch.setattr(tool_engine, "submit", submit)
    return seen


def test_max_tokens_past_the_context_is_lowered_to_the_room_left(tool_client, tool_engine, budgets):  # noqa: F811
    room = tool_engine.context_length - len(tool_engine.chat_tokens(USER, template_kwargs=OFF))
    reply = post_messages(tool_client, {"model": "tool-tiny", "max_tokens": 32000, "messages": USER})
    assert reply.status_code == 200, reply.text
    chat = {"messages": USER, "max_completion_tokens": 10**400, "chat_template_kwargs": OFF}
    assert tool_client.post("/v1/chat/completions", json=chat).status_code == 200
    assert budgets == [room, room]


def test_openai_fields_about_a_hosted_service_are_accepted(tool_client, budgets):  # noqa: F811
    client = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=tool_client, max_retries=0)
    reply = client.chat.completions.create(
        model="tool-tiny",
        messages=USER,
        max_tokens=5,
        store=True,
        metadata={"session": "abc"},
        prompt_cache_key="session-abc",
        service_tier="auto",
        user="me",
        parallel_tool_calls=True,
        safety_identifier="hash-1",
        reasoning_effort="low",
    )
    assert reply.choices[0].message.model_extra["reasoning_content"] == "ok"  # low effort: thinking on
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tool-tiny", messages=USER, extra_body={"store": "yes"})


@pytest.mark.parametrize(
    "fields, kwargs",
    [
        ({"reasoning_effort": "none"}, {"enable_thinking": False}),
        ({"reasoning_effort": "minimal"}, {"enable_thinking": False, "reasoning_effort": "low"}),
        ({"reasoning_effort": "high"}, {"enable_thinking": True, "reasoning_effort": "high"}),
        (
            {"reasoning_effort": "high", "chat_template_kwargs": OFF},
            {"enable_thinking": False, "reasoning_effort": "high"},
        ),
    ],
)
def test_reasoning_effort_maps_to_the_template(fields, kwargs):
    req = oa.parse_request({"messages": USER} | fields, "chat", oa.Defaults(16, 1.0, 1.0))
    assert req.template_kwargs == kwargs


def test_reasoning_effort_none_renders_thinking_off(tool_client, tool_engine, budgets):  # noqa: F811
    reply = tool_client.post("/v1/chat/completions", json={"messages": USER, "reasoning_effort": "none"})
    assert reply.json()["usage"]["prompt_tokens"] == len(tool_engine.chat_tokens(USER, template_kwargs=OFF))


# --- the model list -------------------------------------------------------------------------------------


def test_models_in_anthropics_shape(plain_client, plain_engine):  # noqa: F811
    client = sdk(plain_client)
    listed = client.models.list()
    (card,) = listed.data
    assert (card.type, card.id, card.display_name) == ("model", plain_engine.model_name, plain_engine.model_name)
    raw = plain_client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert raw["has_more"] is False and raw["first_id"] == raw["last_id"] == plain_engine.model_name
    assert raw["data"][0]["created_at"].endswith("Z")
    assert client.models.retrieve(plain_engine.model_name).id == plain_engine.model_name
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-sonnet-4-5")


def test_models_retrieve_in_openais_shape(plain_client, plain_engine):  # noqa: F811
    client = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=plain_client, max_retries=0)
    card = client.models.retrieve(plain_engine.model_name)
    assert (card.id, card.object, card.owned_by) == (plain_engine.model_name, "model", "mlx-kvserve")
    assert plain_client.get("/v1/models").json()["object"] == "list"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


# --- keep-alive during a long prefill -----------------------------------------------------------------------


@pytest.fixture
def slow_prefill(tool_engine, monkeypatch):  # noqa: F811
    """The first token comes after 0.5 s; keep-alives are due every 0.05 s."""
    monkeypatch.setattr(sse, "KEEP_ALIVE_S", 0.05, raising=False)  # absent before keep-alives existed

    def submit(req):
        def run():
            time.sleep(0.5)
            req.emit(TextDelta("Hello", 1))
            req.emit(Finished("stop", Usage(len(req.prompt_tokens), 1), 0.01))

        threading.Thread(target=run).start()

    monkeypatch.setattr(tool_engine, "submit", submit)


def test_a_long_prefill_streams_anthropic_pings(tool_client, slow_prefill):  # noqa: F811
    body = {"model": "tool-tiny", "max_tokens": 5, "messages": USER, "stream": True}
    text = post_messages(tool_client, body).text
    before_reply = text.split("event: content_block_start")[0]
    assert before_reply.count("event: ping") >= 3  # the one after message_start, then keep-alives
    with sdk(tool_client).messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
        assert stream.get_final_message().content[0].text == "Hello"


def test_a_long_prefill_streams_openai_comment_lines(tool_client, slow_prefill):  # noqa: F811
    body = {"messages": USER, "stream": True, "chat_template_kwargs": OFF}
    text = tool_client.post("/v1/chat/completions", json=body).text
    assert text.split('"content": "Hello"')[0].count(": keep-alive\n\n") >= 3
    client = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=tool_client, max_retries=0)
    chunks = list(client.chat.completions.create(model="tool-tiny", messages=USER, stream=True, extra_body=body))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"


def test_no_keep_alive_when_tokens_come_at_once(tool_client, scripted):  # noqa: F811
    scripted += ["Hello"]
    text = post_messages(tool_client, {"model": "tool-tiny", "max_tokens": 5, "messages": USER, "stream": True}).text
    assert text.count("event: ping") == 1
