"""/v1/embeddings (issue 27): a `[[models]]` entry with kind = "embedding" served by a decoder model that
mlx-lm loads. The vectors equal a forward pass computed here (last-token or mean pooling of the final
hidden states, L2-normalized), several inputs in one request equal each sent alone, token ids and base64
give the same vectors, `dimensions` is honoured only as the entry allows, and a chat model named for
embeddings (or an embedding model named for chat) is a 400 before anything loads. On a tiny random-weight
llama, and (slow) on the shipped SmolLM2."""

from __future__ import annotations

import base64

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load
from starlette.testclient import TestClient

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.embedding import batches, check_dimensions, fit_dimensions
from mlx_kvserve.errors import ConfigError, InvalidRequestError, ValidationError
from mlx_kvserve.model_entries import ModelEntry, model_entries
from mlx_kvserve.registry.front import RoutedEngine
from mlx_kvserve.registry.registry import ModelRegistry
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.embeddings import parse_embedding_request

TEXTS = ["The cat sat on the mat.", "hello", "Embeddings of a decoder model, pooled at its last token."]


def expected(folder, texts: list[str], pooling: str = "last") -> np.ndarray:
    """The vectors computed directly: each text alone through mlx-lm's model, pooled, normalized."""
    model, tokenizer = load(str(folder))
    rows = []
    for text in texts:
        hidden = model.model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32)
        v = np.array(hidden[-1] if pooling == "last" else hidden.mean(axis=0))
        rows.append(v / np.linalg.norm(v))
    return np.stack(rows)


def serve(folder, tmp_path, monkeypatch) -> tuple[TestClient, ModelRegistry]:
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    config = load_config(overrides={"ssd": {"cache_dir": str(tmp_path / "kv")}})
    entries = (
        ModelEntry("chat", str(folder)),
        ModelEntry("embed", str(folder), aliases=("text-embedding-3-small",), kind="embedding"),
        ModelEntry("embed-mean", str(folder), kind="embedding", pooling="mean", min_dimensions=16),
    )
    registry = ModelRegistry(config, entries)
    client = TestClient(create_app(RoutedEngine(registry), ApiKeys("", ""), registry))
    return client, registry


@pytest.fixture
def tiny(tiny_model_dir, tmp_path, monkeypatch):
    client, registry = serve(tiny_model_dir, tmp_path, monkeypatch)
    with client:
        yield client, registry


def embed(client: TestClient, status: int = 200, **body) -> dict:
    reply = client.post("/v1/embeddings", json={"model": "embed", **body})
    assert reply.status_code == status, reply.text
    return reply.json()


def vectors(reply: dict) -> np.ndarray:
    assert [d["index"] for d in reply["data"]] == list(range(len(reply["data"])))
    assert all(d["object"] == "embedding" for d in reply["data"])
    return np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)


def test_vectors_equal_a_direct_forward_pass_and_batching_changes_nothing(tiny, tiny_model_dir):
    client, registry = tiny
    want = expected(tiny_model_dir, TEXTS)
    together = embed(client, input=TEXTS)
    assert together["object"] == "list" and together["model"] == "embed"
    got = vectors(together)
    assert got.shape == (3, 64)  # the tiny llama's hidden size
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    alone = np.concatenate([vectors(embed(client, input=t)) for t in TEXTS])
    np.testing.assert_allclose(got, alone, atol=2e-5)
    assert not np.allclose(got[0], got[1], atol=1e-3)  # different texts, different vectors
    _, tokenizer = load(str(tiny_model_dir))
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert together["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    by_ids = embed(client, input=ids)
    np.testing.assert_allclose(vectors(by_ids), got, atol=1e-6)
    one_list = embed(client, input=ids[1], model="text-embedding-3-small")  # an alias, echoed as sent
    assert one_list["model"] == "text-embedding-3-small"
    np.testing.assert_allclose(vectors(one_list)[0], got[1], atol=1e-6)
    b64 = embed(client, input=TEXTS, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    np.testing.assert_array_equal(decoded, got)
    rows = {r["id"]: r for r in client.get("/v1/models").json()["data"]}
    assert rows["embed"]["kind"] == "embedding" and rows["embed"]["state"] == "loaded"
    assert rows["chat"]["kind"] == "chat" and rows["chat"]["state"] == "unloaded"


def test_mean_pooling_and_dimensions(tiny, tiny_model_dir):
    client, _ = tiny
    got = vectors(embed(client, input=TEXTS, model="embed-mean"))
    np.testing.assert_allclose(got, expected(tiny_model_dir, TEXTS, "mean"), atol=2e-5)
    cut = vectors(embed(client, input=TEXTS, model="embed-mean", dimensions=16))  # min_dimensions = 16
    np.testing.assert_allclose(cut, got[:, :16] / np.linalg.norm(got[:, :16], axis=1, keepdims=True), atol=1e-6)
    assert vectors(embed(client, input=TEXTS, model="embed-mean", dimensions=64)).shape == (3, 64)
    for model, dims in (("embed-mean", 8), ("embed-mean", 65), ("embed", 32)):
        error = embed(client, 400, input="x", model=model, dimensions=dims)["error"]
        assert error["param"] == "dimensions" and str(dims) in error["message"]


def test_the_wrong_kind_of_model_is_a_400_before_anything_loads(tiny):
    client, registry = tiny
    error = embed(client, 400, input="x", model="chat")["error"]
    assert error["code"] == "model_not_embedding" and "'chat' is a chat model" in error["message"]
    body = {"model": "embed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_not_chat"
    reply = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 400 and "embedding model" in reply.json()["error"]["message"]
    assert client.get("/v1/cache/stats", params={"model": "embed"}).status_code == 400
    assert embed(client, 404, input="x", model="nope")["error"]["code"] == "model_not_found"
    assert {s.entry.name: s.state for s in registry.slots} == {
        "chat": "unloaded",
        "embed": "unloaded",
        "embed-mean": "unloaded",
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "64"}, "dimensions"),
        ({"input": "a", "temperature": 1}, "temperature"),
        ({"input": ["a"] * 2049}, "input"),
    ],
)
def test_malformed_requests_are_422_naming_the_field(body, param):
    with pytest.raises(ValidationError) as caught:
        parse_embedding_request(body)
    assert caught.value.param == param


def test_token_ids_out_of_the_vocabulary_or_past_the_context_are_refused(tiny):
    client, _ = tiny
    assert embed(client, 422, input=[[5, 10**6]])["error"]["param"] == "input"
    assert "at most 2048" in embed(client, 400, input=[7] * 2049)["error"]["message"]


def test_pure_parts():
    req = parse_embedding_request({"input": [[1, 2], [3]], "dimensions": 8, "user": "u"})
    assert req.token_lists == [[1, 2], [3]] and req.texts is None and req.num_inputs == 2 and req.dimensions == 8
    assert batches([5, 1, 3, 100], max_tokens=12) == [[1, 2], [0], [3]]  # by length; 3 x 5 > 12
    assert batches([2] * 5, max_tokens=100, max_batch=2) == [[0, 1], [2, 3], [4]]
    check_dimensions(None, 64, 0, "m")
    check_dimensions(64, 64, 0, "m")
    check_dimensions(32, 64, 32, "m")
    with pytest.raises(InvalidRequestError, match="only 64"):
        check_dimensions(32, 64, 0, "m")
    v = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    np.testing.assert_allclose(fit_dimensions(v, 2, True), [[0.6, 0.8]])
    np.testing.assert_allclose(fit_dimensions(v, 2, False), [[3.0, 4.0]])
    entry = model_entries([{"name": "e", "source": "s", "kind": "embedding", "pooling": "mean"}])[0]
    assert (entry.kind, entry.pooling, entry.normalize, entry.min_dimensions) == ("embedding", "mean", True, 0)
    for bad in ({"kind": "rerank"}, {"pooling": "cls"}, {"min_dimensions": -1}):
        with pytest.raises(ConfigError):
            model_entries([{"name": "e", "source": "s", **bad}])


@pytest.mark.slow
def test_smollm2_embeddings_equal_its_forward_pass(smollm_dir, tmp_path, monkeypatch):
    client, _ = serve(smollm_dir, tmp_path, monkeypatch)
    with client:
        got = vectors(embed(client, input=TEXTS))
        alone = np.concatenate([vectors(embed(client, input=t)) for t in TEXTS])
    want = expected(smollm_dir, TEXTS)
    assert got.shape == (3, 576)  # SmolLM2-135M's hidden size
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(got, alone, atol=1e-4)
    sims = got @ got.T
    assert sims[0, 1] < 0.999 and sims[0, 2] < 0.999


def test_a_one_model_server_answers_embeddings_with_a_400(tiny_model_dir, tmp_path, monkeypatch):
    """Without [[models]] the one model is a chat model: /v1/embeddings names that, and holds no MLX work."""
    import json

    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import LoadedModel

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    model, tokenizer = load(str(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    engine = Engine(
        LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048),
        load_config(overrides={"ssd": {"cache_dir": str(tmp_path / "kv")}}),
    )
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        reply = client.post("/v1/embeddings", json={"input": "x"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_not_embedding"
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": "x"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_not_embedding"
        reply = client.post("/v1/embeddings", json={"model": "embed", "input": "x"})  # a name not served: as chat does
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        assert "'embed' not found" in reply.json()["error"]["message"]
        assert client.post("/v1/embeddings", json={"input": []}).status_code == 422
