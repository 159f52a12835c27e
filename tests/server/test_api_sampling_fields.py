"""OpenAI's presence_penalty, frequency_penalty, logit_bias and n (issue 24, item 3), on the tiny
model: the processors' semantics without a model, their effect on greedy decoding through the
engine and the API, the 422s, and n choices (identical when greedy, seed + i when sampled,
streamed with their indices, the prompt prefilled once)."""

from __future__ import annotations

import collections
import json

import mlx.core as mx
import openai
import pytest
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_batching import alone
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.request import SamplingParams
from mlx_kvserve.engine.sampling.sampler import make_request_processors
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

PROMPT = [5, 17, 42, 99, 123, 7, 64, 31]
REPEATING = [109] * 12  # "jjjj…": the tiny model (seed 0) answers with "?" over and over
REPEATED = "?"
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    model, tokenizer = load(str(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048)


@pytest.fixture(scope="module")
def engine(loaded, tmp_path_factory):
    return make_engine(loaded, tmp_path_factory.mktemp("sampling-fields"))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ApiKeys("", ""))) as c:
        yield c


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client, max_retries=0)


def complete(client, **fields) -> dict:
    reply = client.post(TEXT, json={"prompt": REPEATING, "max_tokens": 40, "temperature": 0} | fields)
    assert reply.status_code == 200, reply.text
    return reply.json()


# --- the processors, without a model ------------------------------------------------------------------


def process(params: SamplingParams, contexts: list[list[int]], vocab: int = 8) -> list[list[float]]:
    """The logits (all zero before) each call of the processors gives, called as mlx-lm does: the
    prompt first, then the prompt and each sampled token."""
    processors = make_request_processors(params)
    out = []
    for context in contexts:
        logits = mx.zeros((1, vocab))
        for processor in processors:
            logits = processor(mx.array(context), logits)
        out.append(logits[0].tolist())
    return out


def test_penalties_count_the_completion_only_with_openais_formula():
    prompt = [3, 3, 3, 5]
    params = SamplingParams(8, presence_penalty=0.5, frequency_penalty=0.25)
    first, second, third = process(params, [prompt, [*prompt, 3], [*prompt, 3, 3, 6]])
    assert first == [0.0] * 8  # the prompt's tokens are not counted (mlx-lm's own processors do count them)
    assert second[3] == pytest.approx(-0.75) and second.count(0.0) == 7
    assert third[3] == pytest.approx(-1.0) and third[6] == pytest.approx(-0.75) and third[5] == 0.0


def test_logit_bias_adds_and_refuses_ids_past_the_logits():
    (logits,) = process(SamplingParams(8, logit_bias=((1, 100.0), (6, -2.5))), [[0]])
    assert logits[1] == 100.0 and logits[6] == -2.5 and logits.count(0.0) == 6
    with pytest.raises(ValueError, match="logit_bias"):
        process(SamplingParams(8, logit_bias=((9, 1.0),)), [[0]])
    assert make_request_processors(SamplingParams(8)) == []


# --- through the engine: token ids ----------------------------------------------------------------------


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_reduce_greedy_repetition(loaded, penalty):
    model, tokenizer = loaded.model, loaded.tokenizer

    def most_repeated(**fields) -> int:
        ids = alone(model, tokenizer, REPEATING, SamplingParams(40, **fields)).done.token_ids
        assert len(ids) == 40
        return collections.Counter(ids).most_common(1)[0][1]

    assert most_repeated() >= 20
    assert most_repeated(**{penalty: 2.0}) <= 3
    assert most_repeated(**{penalty: -2.0}) >= most_repeated()  # a negative penalty favours repeats


# --- through the API -----------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_api_penalties_reduce_repetition(client, penalty):
    plain = complete(client)["choices"][0]["text"]
    assert plain.count(REPEATED) >= 20
    for value in (1.0, 2.0):
        penalised = complete(client, **{penalty: value})["choices"][0]["text"]
        assert penalised.count(REPEATED) <= 3, penalised
        assert complete(client, **{penalty: value})["choices"][0]["text"] == penalised  # greedy: deterministic


def test_logit_bias_100_forces_a_token_whole_streamed_and_chat(client):
    forced = complete(client, logit_bias={"65": 100}, max_tokens=8)  # token 65 is ">"
    assert forced["choices"][0]["text"] == ">" * 8
    chat = sdk(client).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logit_bias={"65": 100}
    )
    assert chat.choices[0].message.content == ">" * 5
    chunks = sdk(client).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.8, seed=3, logit_bias={"65": 100}, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ">" * 4


def test_logit_bias_minus_100_bans_the_greedy_token(client, loaded):
    logits = loaded.model(mx.array(PROMPT)[None])[0, -1]
    first, second = mx.argsort(-logits)[:2].tolist()
    decode = loaded.tokenizer.decode
    assert decode([first]) != decode([second])  # told apart by their text
    plain = complete(client, prompt=PROMPT, max_tokens=1)["choices"][0]["text"]
    banned = complete(client, prompt=PROMPT, max_tokens=1, logit_bias={str(first): -100})["choices"][0]["text"]
    assert plain == decode([first]) and banned == decode([second])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"logit_bias": []}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": "up"}}, "logit_bias"),
        ({"logit_bias": {"262": 5}}, "logit_bias"),  # the tiny model's ids are 0..261
        ({"logit_bias": {"99999999999999": 5}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": "2"}, "n"),
    ],
)
@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_bad_values_are_a_422_naming_the_field(client, path, fields, param):
    body = {"messages": [{"role": "user", "content": "x"}]} if path == CHAT else {"prompt": PROMPT}
    reply = client.post(path, json=body | {"max_tokens": 2} | fields)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == param


# --- n ---------------------------------------------------------------------------------------------------


def test_n_greedy_gives_identical_choices_and_sums_their_tokens(client):
    reply = complete(client, prompt=PROMPT, max_tokens=6, n=3, logprobs=0)
    choices = reply["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 1
    each = len(choices[0]["logprobs"]["tokens"])
    assert all(len(c["logprobs"]["tokens"]) == each for c in choices)
    assert reply["usage"]["completion_tokens"] == 3 * each
    assert reply["usage"]["prompt_tokens"] == len(PROMPT)  # the prompt counted once
    chat = sdk(client).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1


def test_n_seeded_choices_differ_and_are_reproducible(client):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    first = complete(client, **body, n=3)["choices"]
    again = complete(client, **body, n=3)["choices"]
    assert [c["text"] for c in first] == [c["text"] for c in again]
    assert len({c["text"] for c in first}) > 1
    for i in range(3):  # choice i samples with seed + i
        alone_text = complete(client, **body | {"seed": 7 + i})["choices"][0]["text"]
        assert alone_text == first[i]["text"]


def sse_payloads(text: str) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_n_streamed_delivers_every_index(client, path):
    body = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": PROMPT}
    body |= {"max_tokens": 5, "temperature": 0, "n": 2}
    whole = client.post(path, json=body).json()
    reply = client.post(path, json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert reply.status_code == 200
    payloads = sse_payloads(reply.text)
    texts: dict[int, str] = collections.defaultdict(str)
    reasons: dict[int, str] = {}
    for payload in payloads[:-1]:
        (choice,) = payload["choices"]
        piece = choice["delta"].get("content") if path == CHAT else choice["text"]
        texts[choice["index"]] += piece or ""
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == sorted(reasons) == [0, 1]
    key = "message" if path == CHAT else None
    expected = [c[key]["content"] if key else c["text"] for c in whole["choices"]]
    assert [texts[0], texts[1]] == expected
    usage, counted = payloads[-1]["usage"], whole["usage"]
    assert payloads[-1]["choices"] == [] and usage["completion_tokens"] == counted["completion_tokens"]
    assert usage["prompt_tokens"] == counted["prompt_tokens"]


def test_n_choices_share_the_prompts_prefill(client, engine):
    prompt = [(7 * i) % 250 + 3 for i in range(5 * 16 + 3)]  # 5 whole blocks and a partial one
    before = engine.batch_stats()["prefill_tokens"]
    cold = complete(client, prompt=prompt, max_tokens=2, n=3)
    prefilled = engine.batch_stats()["prefill_tokens"] - before
    assert prefilled < 2 * len(prompt), prefilled  # once, and the partial block once per choice
    assert cold["usage"]["prompt_tokens"] == len(prompt)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the first choice found nothing cached
    warm = complete(client, prompt=prompt, max_tokens=2, n=3)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * 16  # its blocks (and tail)
