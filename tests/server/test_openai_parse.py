"""OpenAI request parsing and the completion budget: pure functions, no model."""

import pytest

from mlx_kvserve.engine.request import SamplingParams, Usage
from mlx_kvserve.errors import InvalidRequestError, ValidationError
from mlx_kvserve.server.openai import parse as oa
from mlx_kvserve.server.openai import reply as oar

DEFAULTS = oa.Defaults(max_tokens=512, temperature=0.7, top_p=0.9)
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return oa.parse_request({"messages": USER, **fields}, "chat", DEFAULTS)


def text(**fields):
    return oa.parse_request({"prompt": "once upon", **fields}, "text", DEFAULTS)


def test_chat_defaults():
    req = chat()
    assert req.kind == "chat"
    assert req.messages == USER
    assert req.prompt is None
    assert req.model is None
    assert req.max_tokens is None
    assert req.temperature == 0.7
    assert req.top_p == 0.9
    assert req.seed is None
    assert req.stop == ()
    assert req.stream is False
    assert req.include_usage is False


def test_chat_fields():
    req = chat(
        model="m",
        max_tokens=10,
        temperature=0,
        top_p=0.5,
        seed=42,
        stop="END",
        stream=True,
        stream_options={"include_usage": True},
    )
    assert (req.model, req.max_tokens, req.temperature, req.top_p, req.seed) == ("m", 10, 0.0, 0.5, 42)
    assert req.stop == ("END",)
    assert req.stream is True and req.include_usage is True
    assert req.sampling(7) == SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, seed=42, stop=("END",))


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=10, max_completion_tokens=20).max_tokens == 20
    assert chat(max_tokens=10, max_completion_tokens=None).max_tokens == 10


def test_message_content_parts_and_null_assistant_content():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
    ]
    req = oa.parse_request({"messages": messages}, "chat", DEFAULTS)
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
    ]


def test_prompt_forms():
    assert text().prompt == "once upon"
    assert text(prompt=["a single string"]).prompt == "a single string"
    assert text(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert text().messages is None


def test_stop_list():
    assert chat(stop=["a", "bc"]).stop == ("a", "bc")
    assert chat(stop=None).stop == ()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["s"] * 9}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": "yes"}}, "include_usage"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"model": 5}, "model"),
    ],
)
def test_chat_validation_errors(fields, param):
    with pytest.raises(ValidationError) as info:
        oa.parse_request({"messages": USER, **fields}, "chat", DEFAULTS)
    assert info.value.status_code == 422
    assert info.value.param == param
    assert param.split("[")[0] in info.value.message


@pytest.mark.parametrize("prompt", [None, "", [], [1, "a"], [True], {"text": "x"}, 5])
def test_prompt_validation_errors(prompt):
    with pytest.raises(ValidationError) as info:
        oa.parse_request({"prompt": prompt}, "text", DEFAULTS)
    assert info.value.param == "prompt"


@pytest.mark.parametrize("body", [[], "text", None, 3])
def test_body_must_be_an_object(body):
    with pytest.raises(ValidationError, match="JSON object"):
        oa.parse_request(body, "chat", DEFAULTS)


def test_budget_default_is_capped_by_the_context():
    assert oa.completion_budget(chat(), num_prompt=100, context=2048, default_max=512) == 512
    assert oa.completion_budget(chat(), num_prompt=2000, context=2048, default_max=512) == 48


def test_budget_explicit_max_tokens():
    assert oa.completion_budget(chat(max_tokens=48), num_prompt=2000, context=2048, default_max=512) == 48
    # More than the context has room for is lowered to the room, not refused (Claude Code asks for 32000).
    assert oa.completion_budget(chat(max_tokens=32000), num_prompt=2000, context=2048, default_max=512) == 48


@pytest.mark.parametrize(("kind", "param"), [("chat", "messages"), ("text", "prompt")])
def test_budget_prompt_fills_the_context(kind, param):
    req = chat() if kind == "chat" else text()
    with pytest.raises(InvalidRequestError) as info:
        oa.completion_budget(req, num_prompt=2048, context=2048, default_max=512)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert info.value.code == "context_length_exceeded"
    assert oa.completion_budget(req, num_prompt=2047, context=2048, default_max=512) == 1


def test_response_shapes():
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    body = oar.response_body(chat(), "chatcmpl-1", "m", "hello", "stop", usage)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    body = oar.response_body(text(), "cmpl-1", "m", "hello", "cancelled", usage)
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "hello"
    assert body["choices"][0]["finish_reason"] == "length"


def test_chunk_shapes():
    first = oar.chunk_body(chat(), "id", "m", "", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = oar.chunk_body(chat(), "id", "m", None, "length")
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "length"
    usage = oar.usage_chunk(text(), "id", "m", Usage(1, 2))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3


def test_error_body_and_ids():
    assert oar.error_body("bad", "invalid_request_error", "seed") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "seed", "code": None}
    }
    assert oar.new_id("chat").startswith("chatcmpl-")
    assert oar.new_id("text").startswith("cmpl-")
    assert oar.new_id("chat") != oar.new_id("chat")


def test_n_penalties_and_logit_bias_reach_each_choices_sampling():
    req = chat(n=3, seed=5, presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100, "3": 2.5, "03": 1})
    assert req.n == 3
    params = [req.sampling(10, choice=i) for i in range(3)]
    assert [p.seed for p in params] == [5, 6, 7]  # choice i samples with seed + i
    assert params[0].presence_penalty == 0.5 and params[0].frequency_penalty == -1.0
    assert params[0].logit_bias == ((3, 1.0), (7, -100.0))  # "03" is token 3 too: the later key wins
    assert chat(seed=2**64 - 1, n=2).sampling(10, choice=1).seed == 0
    assert chat(n=2).sampling(10, choice=1).seed is None
