"""llama.cpp's `return_progress` (issue 49): a streamed completion that asks gets chunks with an empty
delta and `prompt_progress` while its prompt prefills, then the normal stream; one that does not ask
gets none; the official openai SDK reads such a stream."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient
from test_api_anthropic import _loaded

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.openai import progress


def _prompt(seed: int) -> list[int]:  # ~94 prefill steps of 16 tokens; each test its own (uncached)
    return [(i * 37 + seed) % 250 + 3 for i in range(1500)]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MLX_KVSERVE_HOME", str(tmp_path_factory.mktemp("progress") / "home"))
    mp.setattr(progress, "POLL_S", 0.01)  # read often: the tiny model's prefill takes about a second
    overrides = {"generation": {"prefill_step_size": 16}, "ssd": {"enabled": False}}
    engine = Engine(_loaded(tiny_model_dir, "tiny"), load_config(overrides=overrides))
    with TestClient(create_app(engine, ApiKeys("", ""))) as c:
        yield c
    mp.undo()


def _chunks(client, prompt: list[int], **fields) -> list[dict]:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True, **fields}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_stream_that_asks_gets_the_prefill_progress_then_its_tokens(client):
    chunks = _chunks(client, _prompt(11), return_progress=True)
    marks = [i for i, c in enumerate(chunks) if "prompt_progress" in c]
    assert marks, "no progress chunk"
    first_text = next(i for i, c in enumerate(chunks) if c["choices"][0]["text"])
    assert max(marks) < first_text  # all before the first token
    seen = [chunks[i]["prompt_progress"] for i in marks]
    assert all(p["total"] == 1500 and p["cache"] == 0 for p in seen), seen
    processed = [p["processed"] for p in seen]
    assert processed == sorted(set(processed)) and 0 < processed[0] and processed[-1] <= 1500, processed
    assert all(p["time_ms"] >= 0 for p in seen)
    assert all(chunks[i]["choices"][0]["text"] == "" for i in marks)  # nothing for other clients to show
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stream_that_does_not_ask_gets_no_progress(client):
    chunks = _chunks(client, _prompt(12))
    assert chunks and not any("prompt_progress" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_openai_sdk_reads_a_chat_stream_with_progress(client):
    sdk = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client, max_retries=0)
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "tell me more " * 120}],
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_body={"return_progress": True},
    )
    chunks = list(stream)
    progress_chunks = [c for c in chunks if (c.model_extra or {}).get("prompt_progress")]
    assert progress_chunks, "no progress chunk"
    assert all(c.choices[0].delta.content is None for c in progress_chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_return_progress_must_be_a_boolean(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "return_progress": "yes"})
    assert r.status_code == 422 and "return_progress" in r.text
