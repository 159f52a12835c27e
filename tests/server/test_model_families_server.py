"""Model families through the HTTP API: a hybrid model's chats hit at message starts (a new
question under the same system prompt, the next turn of a conversation), /health names the
layout, and a model whose cache layout cannot be cached keeps serving with caching off and the
reason on /health."""

from __future__ import annotations

import json

import pytest
from familymodels import build_family_model
from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.cache.message_starts import message_starts, turn_start_token
from mlx_kvserve.errors import ModelLoadError
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

SYSTEM = " ".join(f"Rule {i}: answer rivers question {i} with the town {i * 7}." for i in range(12))


def _loaded(folder) -> LoadedModel:
    model, tokenizer = load(str(folder))
    return LoadedModel("fam", folder, model, tokenizer, json.loads((folder / "config.json").read_text()), 2048)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return _loaded(build_family_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5"))


def _chat(client, messages):
    body = {"model": "fam", "messages": messages, "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]


def test_turn_marker_is_the_templates_message_opener(hybrid):
    tokenizer = hybrid.tokenizer
    marker = turn_start_token(tokenizer)
    assert marker == tokenizer.convert_tokens_to_ids("<|im_start|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], add_generation_prompt=True
    )
    starts = [p for p, t in enumerate(prompt) if t == marker]
    assert len(starts) == 3 and starts[0] == 0  # system, user, the assistant's turn
    assert message_starts(prompt, marker, after=0) == starts[1:]
    assert message_starts(prompt, None, after=0) == []


def test_hybrid_chats_hit_at_message_starts_and_health_names_the_layout(hybrid, tmp_path):
    engine = make_engine(hybrid, tmp_path)
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        system = {"role": "system", "content": SYSTEM}
        first = [system, {"role": "user", "content": "Which town is on river 3?"}]
        reply, usage = _chat(client, first)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        # Another question under the same system prompt: everything before the user message is cached.
        shared = len(engine.chat_tokens([system], add_generation_prompt=False))
        _, usage = _chat(client, [system, {"role": "user", "content": "And river 9, please?"}])
        assert usage["prompt_tokens_details"]["cached_tokens"] == shared
        # The next turn: at least the first prompt, up to where the reply starts, is cached (the
        # random model's reply text may not tokenize back to the tokens it sampled; the engine
        # tests check that a next turn extending the sampled tokens hits all of them).
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
        _, usage = _chat(client, second)
        before_reply = len(engine.chat_tokens(first, add_generation_prompt=False))
        assert usage["prompt_tokens_details"]["cached_tokens"] >= before_reply
        health = client.get("/health").json()
        cache = health["cache"]
        assert cache["enabled"] and cache["layers"] == {"state": 2, "kv": 2}
        assert cache["kv_tails"] >= 3 and cache["kv_tail_bytes"] > 0
        assert health["status"] == "ok", health["problems"]


class _SinkModel:
    """A model whose first layer keeps a sliding window with attention-sink positions at its start
    (RotatingKVCache with keep > 0), a layout the block cache does not take."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)

    def make_cache(self):
        return [RotatingKVCache(max_size=64, keep=4), *[KVCache() for _ in self._inner.layers[1:]]]


def test_a_refused_layout_serves_with_caching_off_and_says_why(tiny_model_dir, tmp_path):
    plain = _loaded(tiny_model_dir)
    loaded = LoadedModel("fam", plain.path, _SinkModel(plain.model), plain.tokenizer, plain.config, 2048)
    engine = make_engine(loaded, tmp_path)
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        messages = [{"role": "user", "content": "Hello there, how are you?"}]
        first, _ = _chat(client, messages)
        again, usage = _chat(client, messages)
        assert again == first and usage["prompt_tokens_details"]["cached_tokens"] == 0
        health = client.get("/health").json()
        assert health["cache"]["enabled"] is False and health["status"] == "ok"
        assert health["cache"]["reason"] == "model cache has RotatingKVCache(keep=4) layers, which are not cached"


class _ChunkedModel(_SinkModel):
    """A model with llama4's chunked attention cache, which mlx-lm's BatchGenerator cannot batch."""

    def make_cache(self):
        return [ChunkedKVCache(64), *[KVCache() for _ in self._inner.layers[1:]]]


def test_a_model_the_batch_cannot_run_is_refused_at_startup(tiny_model_dir, tmp_path):
    plain = _loaded(tiny_model_dir)
    loaded = LoadedModel("chunked", plain.path, _ChunkedModel(plain.model), plain.tokenizer, plain.config, 2048)
    with pytest.raises(ModelLoadError, match="ChunkedKVCache layers cannot be batched"):
        make_engine(loaded, tmp_path)
