"""Structured output (`response_format`, issue 13 item 2) by constrained decoding with llguidance:
whatever the model (here a tiny random one), the completion is JSON valid for the schema, through
the official `openai` client; unconstrained requests batched with a constrained one keep their
greedy output; bad formats and schemas are 4xx."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    model, tokenizer = load(str(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048)


@pytest.fixture(scope="module")
def engine(loaded, tmp_path_factory):
    return make_engine(loaded, tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ApiKeys("", ""))) as c:
        yield c


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client, max_retries=0)


def test_json_schema_output_is_valid_for_the_schema(client):
    reply = sdk(client).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Describe a ball."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA, "strict": True}},
    )
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"


def test_sampled_and_streamed_output_follows_the_schema(client):
    for temperature in (0.0, 1.0):
        stream = sdk(client).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a ball."}],
            max_tokens=120,
            temperature=temperature,
            seed=7,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA}},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gives_an_object(client):
    """Any object is allowed, so the random model may write one long string: the text is an object
    when it ends by itself, and always the start of one."""
    reply = sdk(client).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Anything, as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text.lstrip().startswith("{"), text
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length"


def test_text_completions_take_a_schema_too(client):
    body = {
        "model": "tiny",
        "prompt": "Count:",
        "max_tokens": 80,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


def test_unconstrained_requests_batched_with_a_constrained_one_keep_their_output(engine, loaded):
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode("The harbour at night " * 6), tokenizer.encode("Mountains and rivers " * 5)]
    scheduler = engine.scheduler

    def run(reqs):
        for r in reqs:
            scheduler.admit(r)
        while any(scheduler.is_running(r) for r in reqs):
            scheduler.step()

    alone = []
    for p in prompts:
        events = []
        run([GenerationRequest("a", list(p), SamplingParams(max_tokens=12), events.append)])
        alone.append(events[-1].token_ids)
    events = [[], [], []]
    reqs = [
        GenerationRequest(f"b{i}", list(p), SamplingParams(max_tokens=12), events[i].append)
        for i, p in enumerate(prompts)
    ]
    reqs.append(
        GenerationRequest("c", list(prompts[0]), SamplingParams(max_tokens=60, json_schema=SCHEMA), events[2].append)
    )
    run(reqs)
    assert [e[-1].token_ids for e in events[:2]] == alone
    done = events[2][-1]
    assert isinstance(done, Finished)
    jsonschema.validate(json.loads(tokenizer.decode(list(done.token_ids))), SCHEMA)


@pytest.mark.parametrize(
    "fmt, status",
    [
        ({"type": "xml"}, 422),
        ({"type": "json_schema"}, 422),
        ({"type": "json_schema", "json_schema": {"schema": []}}, 422),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, 400),
        ("json", 422),
    ],
)
def test_bad_formats_and_schemas_are_4xx(client, fmt, status):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_text_format_is_plain_text(client):
    """{"type": "text"} constrains nothing: the same greedy reply as a request without a format."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body)
    text = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}})
    assert plain.status_code == text.status_code == 200, text.text
    assert text.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    assert text.json()["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"] > 0
