"""Reasoning over the OpenAI API (issue 13, item 3): for a model with thinking tokens, the text inside
its think block goes to `reasoning_content` (streamed as `delta.reasoning_content`), apart from
`content`; `chat_template_kwargs` reach the chat template per request.
"""

from __future__ import annotations

import pytest
from mlx_lm.utils import load
from test_api_tools import (  # noqa: F401  (fixtures)
    USER,
    parse,
    scripted,
    sdk,
    split,
    tool_client,
    tool_engine,
    tool_loaded,
)

from mlx_kvserve.errors import InvalidRequestError, ValidationError

OFF = {"enable_thinking": False}


def test_a_prompt_that_opens_the_think_block_starts_the_reply_in_reasoning(tool_engine, tool_loaded):  # noqa: F811
    tokenizer = tool_loaded.tokenizer
    opened = tool_engine.chat_tokens(USER)  # the template opens <think> (thinking on by default)
    closed = tool_engine.chat_tokens(USER, template_kwargs=OFF)
    for step in (0, 1, 4):
        (content, reasoning, _), _ = split(tokenizer, "plan: a, b</think>\n\nAnswer", None, step, opened)
        assert (reasoning, content) == ("plan: a, b", "\n\nAnswer")
        (content, reasoning, _), _ = split(tokenizer, "Answer <think>again</think> done", None, step, closed)
        assert (reasoning, content) == ("again", "Answer  done")


def test_a_think_block_cut_short_is_all_reasoning(tool_loaded, tool_engine):  # noqa: F811
    opened = tool_engine.chat_tokens(USER)
    (content, reasoning, _), _ = split(tool_loaded.tokenizer, "still thinking </thi", None, 1, opened)
    assert (reasoning, content) == ("still thinking </thi", "")


def test_a_model_without_thinking_tokens_keeps_think_text_as_content(tiny_model_dir):
    _, tokenizer = load(str(tiny_model_dir))
    assert not tokenizer.has_thinking
    (content, reasoning, _), _ = split(tokenizer, "<think>x</think>y", None, 1)
    assert (reasoning, content) == ("", "<think>x</think>y")


def test_chat_template_kwargs_are_checked():
    assert parse(chat_template_kwargs=OFF).template_kwargs == OFF
    with pytest.raises(ValidationError):
        parse(chat_template_kwargs=["enable_thinking"])
    with pytest.raises(InvalidRequestError, match="add_generation_prompt") as err:
        parse(chat_template_kwargs={"add_generation_prompt": False})
    assert err.value.param == "chat_template_kwargs"


def test_chat_template_kwargs_reach_the_template(tool_client, tool_engine):  # noqa: F811
    client = sdk(tool_client)
    on = client.chat.completions.create(model="tool-tiny", messages=USER, max_tokens=1)
    off = client.chat.completions.create(
        model="tool-tiny", messages=USER, max_tokens=1, extra_body={"chat_template_kwargs": OFF}
    )
    rendered = tool_engine.loaded.tokenizer.decode(tool_engine.chat_tokens(USER, template_kwargs=OFF))
    assert rendered.endswith("<think>\n\n</think>")
    assert off.usage.prompt_tokens == len(tool_engine.chat_tokens(USER, template_kwargs=OFF)) > on.usage.prompt_tokens


def test_reasoning_comes_back_apart_from_content(tool_client, scripted):  # noqa: F811
    scripted += ["First, ", "think.</thi", "nk>\n\nHello"]
    reply = sdk(tool_client).chat.completions.create(model="tool-tiny", messages=USER)
    message = reply.choices[0].message
    assert message.content == "\n\nHello" and message.model_extra["reasoning_content"] == "First, think."
    assert reply.choices[0].finish_reason == "stop"


def test_reasoning_streams_as_its_own_deltas(tool_client, scripted):  # noqa: F811
    scripted += ["First, ", "think.</thi", "nk>\n\nHello", " there"]
    chunks = list(sdk(tool_client).chat.completions.create(model="tool-tiny", messages=USER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("First, think.", "\n\nHello there")
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])
    assert chunks[-1].choices[0].finish_reason == "stop"
