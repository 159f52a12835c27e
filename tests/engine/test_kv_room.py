"""Admission by memory ([server] kv_batch_bytes, engine/batch/kv_room.py): the KV estimate matches what a
prefill really holds, requests whose KV would not fit together wait and then all finish with the output
of a cold run alone, and the budget caps the context the server serves."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvharness import make_generator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_batching import BS, Outcome, _prompts, alone, request

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.batch import kv_room
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.request import SamplingParams
from mlx_kvserve.errors import ConfigError
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

LLAMA = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir), return_config=True)


def test_kv_bytes_per_token_from_the_config():
    # keys and values x 2 layers x 2 KV heads x 16 dims x 4 bytes
    assert kv_room.kv_bytes_per_token(LLAMA, 4) == 2 * 2 * 2 * 16 * 4
    assert kv_room.kv_bytes_per_token(LLAMA | {"head_dim": 32}, 2) == 2 * 2 * 2 * 32 * 2
    # 8-bit KV: one byte a value, a float16 scale and bias per 64 values
    assert kv_room.kv_bytes_per_token(LLAMA, 2, kv_bits=8) == 2 * 2 * 2 * (16 + 4)
    assert kv_room.kv_bytes_per_token({"text_config": LLAMA}, 4) == 512
    assert kv_room.kv_bytes_per_token({}, 4) == 0  # no attention shape: no estimate


def test_the_estimate_is_what_a_prefill_holds(tiny):
    model, _, config = tiny
    room = kv_room.for_model(model, config, 10**9)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(5, 105))]), cache=cache))
    held = sum(c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes for c in cache)
    assert room.bytes_per_token * 100 == held
    allocated = sum(a.nbytes for c in cache for a in (c.keys, c.values))  # grown in whole steps
    assert allocated == room.bytes_per_token * kv_room.STEP


def sized(prompt: int, max_tokens: int):
    return request("r", [1] * prompt, SamplingParams(max_tokens=max_tokens), Outcome([]))


def test_room_counts_a_batch_as_mlx_lm_holds_it():
    step = kv_room.STEP
    room = kv_room.KvRoom(budget_bytes=2 * 2 * step, bytes_per_token=2)  # two rows of one step
    a, b, c = sized(200, 50), sized(10, 5), sized(step, 1)  # 250 and 15 tokens: one step each; c: two
    assert room.max_tokens == 2 * step and room.batch_bytes([a]) == 2 * step
    assert room.batch_bytes([a, c]) == 2 * 2 * 2 * step  # every row as long as the longest
    assert room.fits(b, [a]) and not room.fits(b, [a, b]) and not room.fits(c, [b])
    assert room.fits(sized(5000, 100), [])  # alone always (the context cap keeps such a request out)


def test_a_budget_holding_less_than_a_block_is_refused(tiny):
    model, _, config = tiny
    with pytest.raises(ConfigError, match="server.kv_batch_bytes"):
        kv_room.for_model(model, config, 1000)
    assert kv_room.for_model(model, config, 0) is None


def test_requests_that_do_not_fit_together_wait_then_finish_as_alone(tiny):
    model, tokenizer, config = tiny
    prompts = _prompts(tokenizer)
    jobs = [(prompts[0], 24), (prompts[4], 24), (prompts[2], 24)]  # 83, 113 and 48 prompt tokens
    params = [SamplingParams(max_tokens=n, temperature=0.0) for _, n in jobs]
    gen = make_generator(model, tokenizer, BS)
    per_token = kv_room.for_model(model, config, 10**9).bytes_per_token
    budget = 2 * kv_room.STEP * per_token  # two rows of one step: two of them at most, never all three
    gen.scheduler.kv_room = kv_room.KvRoom(budget, per_token)
    outs = [Outcome([]) for _ in jobs]
    for i, ((prompt, _), p) in enumerate(zip(jobs, params, strict=True)):
        gen.scheduler.admit(request(f"r{i}", prompt, p, outs[i]))
    most = 0
    while gen.scheduler.has_work:
        gen.scheduler.step()
        running = [r.req for r in gen.scheduler._running.values()]
        assert gen.scheduler.kv_room.batch_bytes(running) <= budget
        most = max(most, len(running))
    assert most == 2
    for (prompt, _), p, out in zip(jobs, params, outs, strict=True):
        assert out.key() == alone(model, tokenizer, prompt, p).key()


def test_the_budget_caps_the_context(tiny, tiny_model_dir, tmp_path, monkeypatch):
    model, tokenizer, config = tiny
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    per_token = kv_room.for_model(model, config, 10**9).bytes_per_token
    overrides = {"server": {"kv_batch_bytes": 600 * per_token}, "ssd": {"enabled": False}}
    engine = Engine(
        LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048), load_config(overrides=overrides)
    )
    assert engine.context_length == 512  # 600 tokens' worth, in whole steps
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        assert client.get("/v1/models").json()["data"][0]["context_length"] == 512
        reply = client.post("/v1/completions", json={"prompt": "apples and pears " * 200, "max_tokens": 4})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 512 tokens" in reply.json()["error"]["message"]
        fits = client.post("/v1/completions", json={"prompt": "apples and pears", "max_tokens": 4000})
        assert fits.status_code == 200 and fits.json()["usage"]["total_tokens"] <= 512  # max_tokens lowered
