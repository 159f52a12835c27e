"""logprobs / top_logprobs (issue 13, item 4) and top_k / min_p, through the official `openai`
client on the tiny model: values are the model's own log-softmax, greedy picks the most likely
token, streamed and whole replies agree, and bad values are a 422."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import openai
import pytest
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

PROMPT = [5, 17, 42, 99, 123, 7, 64, 31]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    model, tokenizer = load(str(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048)


@pytest.fixture(scope="module")
def client(loaded, tmp_path_factory):
    engine = make_engine(loaded, tmp_path_factory.mktemp("logprobs"))
    with TestClient(create_app(engine, ApiKeys("", ""))) as c:
        yield c


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client, max_retries=0)


def reference_logprobs(model, tokens: list[int]) -> mx.array:
    logits = model(mx.array(tokens)[None])[0, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits)


def test_completion_logprobs_are_the_models_log_softmax(client, loaded):
    reply = sdk(client).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    expected = reference_logprobs(loaded.model, PROMPT)
    first = int(mx.argmax(expected).item())  # greedy: the sampled token is the most likely one
    assert lp.token_logprobs[0] == pytest.approx(expected[first].item(), abs=1e-3)
    top = lp.top_logprobs[0]
    assert len(top) <= 3 and max(top.values()) == pytest.approx(lp.token_logprobs[0], abs=1e-5)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_whole_and_streamed_agree(client):
    messages = [{"role": "user", "content": "Say something."}]
    api = sdk(client)
    whole = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)  # greedy
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = []
    for chunk in api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=1e-4)


def test_no_logprobs_unless_asked(client):
    reply = sdk(client).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_values_are_a_422(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text


def test_completions_logprobs_bound(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 21})
    assert r.status_code == 422 and r.json()["error"]["param"] == "logprobs"


def test_top_k_one_is_greedy_at_any_temperature(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0}
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
    for seed in (1, 2):
        sampled = client.post("/v1/completions", json={**body, "temperature": 1.5, "top_k": 1, "seed": seed}).json()
        assert sampled["choices"][0]["logprobs"]["tokens"] == greedy["choices"][0]["logprobs"]["tokens"]
    assert all(math.isfinite(v) for v in greedy["choices"][0]["logprobs"]["token_logprobs"])


# --- masked tokens under constrained decoding (issue 23, bug 6) ----------------------------------------------

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
FLAG_FORMAT = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str):
    """JSON as the spec has it: NaN and Infinity are refused (Python's json takes them)."""
    return json.loads(text, parse_constant=_refuse)


def payloads(reply) -> list[dict]:
    """Each SSE event's JSON of a streamed reply, read strictly."""
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [strict_json(line) for line in lines[:-1]]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("stream", [False, True])
def test_constrained_logprobs_omit_masked_alternatives_and_stay_json(client, kind, stream):
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "response_format": FLAG_FORMAT, "stream": stream}
    if kind == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "ok?"}]}
        body |= {"logprobs": True, "top_logprobs": 20}
    else:
        path, body = "/v1/completions", {**body, "prompt": PROMPT, "logprobs": 20}
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    blocks = (
        [c["choices"][0]["logprobs"] for c in payloads(reply)]
        if stream
        else [strict_json(reply.text)["choices"][0]["logprobs"]]
    )
    blocks = [b for b in blocks if b]
    if kind == "chat":
        chosen = [e["logprob"] for b in blocks for e in b["content"]]
        tops = [[t["logprob"] for t in e["top_logprobs"]] for b in blocks for e in b["content"]]
    else:
        chosen = [lp for b in blocks for lp in b["token_logprobs"]]
        tops = [list(top.values()) for b in blocks for top in b["top_logprobs"]]
    assert chosen and all(math.isfinite(lp) for lp in chosen)
    assert all(math.isfinite(lp) for top in tops for lp in top)
    assert min(len(top) for top in tops) < 20  # after '{"ok":' few tokens are possible: the rest are left out
