"""Several models behind one app (issue 27), on two tiny random-weight llamas of different sizes: each
request is answered by the model it names (greedy text equal to that model's alone, also when both
run at once), a budget that holds one unloads the other, a prompt repeated after its model was
unloaded and reloaded is an SSD hit with the same text, unknown ids are a 404 naming the registered
ones, and /v1/models, /health, /metrics and the admin API report each model's state."""

from __future__ import annotations

import threading

import pytest
import tinymodel
from mlx.utils import tree_flatten
from mlx_lm.utils import load
from starlette.testclient import TestClient

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.model_entries import ModelEntry
from mlx_kvserve.registry.front import RoutedEngine
from mlx_kvserve.registry.registry import ModelRegistry
from mlx_kvserve.server.app import create_app

BS = 16
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(4 * BS + 5)]  # 4 full blocks and a tail


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    other = tinymodel.build_mlx_model(tmp_path_factory.mktemp("tiny-b") / "tiny-wide", seed=1, hidden_size=96)
    return {"a": tiny_model_dir, "b": other}


def weights_bytes(folder) -> int:
    model, _ = load(str(folder))
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def make_registry(folders, root, budget: int, policy: str = "write_through") -> ModelRegistry:
    overrides = {
        "server": {"model_memory_bytes": budget},
        "cache": {"block_size": BS},
        "ssd": {"cache_dir": str(root / "kv"), "async_writes": False, "policy": policy},
    }
    entries = (
        ModelEntry("a", str(folders["a"]), aliases=("gpt-4o",)),
        ModelEntry("b", str(folders["b"]), aliases=("claude-sonnet-4-5",)),
    )
    return ModelRegistry(load_config(overrides=overrides), entries)


@pytest.fixture
def app_for(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    made = []

    def make(budget: int, policy: str = "write_through") -> tuple[TestClient, ModelRegistry]:
        registry = make_registry(folders, tmp_path, budget, policy)
        client = TestClient(create_app(RoutedEngine(registry), ApiKeys("", ""), registry))
        client.__enter__()
        made.append(client)
        return client, registry

    yield make
    for client in made:
        client.__exit__(None, None, None)


def complete(client: TestClient, model: str, prompt=PROMPT) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def states(client: TestClient) -> dict[str, str]:
    return {card["id"]: card["state"] for card in client.get("/v1/models").json()["data"]}


@pytest.mark.parametrize("policy", ["write_through", "evict_only"])
def test_a_budget_for_one_model_unloads_the_other_and_a_reload_is_an_ssd_hit(folders, app_for, policy):
    sizes = {name: weights_bytes(folder) for name, folder in folders.items()}
    client, registry = app_for(sum(sizes.values()) - 1, policy)  # either alone fits, not both
    assert states(client) == {"a": "unloaded", "b": "unloaded"}
    first = complete(client, "a")
    assert first["model"] == "a" and states(client) == {"a": "loaded", "b": "unloaded"}
    other = complete(client, "claude-sonnet-4-5")  # an alias: echoed as sent
    assert other["model"] == "claude-sonnet-4-5"
    assert states(client) == {"a": "unloaded", "b": "loaded"}
    assert other["choices"][0]["text"] != first["choices"][0]["text"]  # another model answered
    again = complete(client, "a")
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BS
    stats = client.get("/v1/cache/stats", params={"model": "a"}).json()
    assert stats["kv_promotions"] >= 4  # the blocks came back from the SSD
    rows = {row["id"]: row for row in client.get("/v1/cache/models").json()["models"]}
    assert rows["a"]["loads"] == 2 and rows["a"]["unloads"] == 1 and rows["b"]["unloads"] == 1


def test_both_loaded_answer_at_once_as_each_alone(folders, app_for):
    client, _ = app_for(2**30)
    alone = {m: complete(client, m)["choices"][0]["text"] for m in ("a", "b")}
    results: dict[str, list[str]] = {"a": [], "b": []}
    prompts = [PROMPT[i:] for i in range(0, 8, 2)]

    def run(model: str) -> None:
        for prompt in prompts:
            results[model].append(complete(client, model, prompt)["choices"][0]["text"])

    threads = [threading.Thread(target=run, args=(m,)) for m in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["a"][0] == alone["a"] and results["b"][0] == alone["b"]
    for model in ("a", "b"):  # the same prompts one by one, each model alone
        assert results[model] == [complete(client, model, p)["choices"][0]["text"] for p in prompts]
    assert states(client) == {"a": "loaded", "b": "loaded"}


def test_unknown_ids_are_a_404_naming_the_registered_ones_in_each_apis_shape(app_for):
    client, _ = app_for(2**30)
    reply = client.post("/v1/chat/completions", json={"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and "'a', 'b'" in error["message"]
    body = {"model": "claude-opus-4", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    reply = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 404 and reply.json()["type"] == "error"
    assert client.get("/v1/models/gpt-5").status_code == 404
    assert client.get("/v1/models/gpt-4o").json()["id"] == "a"
    assert states(client) == {"a": "unloaded", "b": "unloaded"}  # nothing loaded for them


def test_health_metrics_and_the_admin_api_report_each_model(app_for):
    client, _ = app_for(2**30)
    assert client.post("/v1/cache/models/load", json={"model": "b"}).json()["state"] == "loaded"
    health = client.get("/health").json()
    assert health["status"] == "ok"
    models = {row["id"]: row for row in health["models"]}
    assert models["b"]["state"] == "loaded" and models["b"]["memory_bytes"] > 0 and "cache" in models["b"]
    assert models["a"]["state"] == "unloaded"
    text = client.get("/metrics").text
    assert 'mlx_kvserve_model_loaded{model="b"} 1.0' in text and 'mlx_kvserve_model_loaded{model="a"} 0.0' in text
    assert client.post("/v1/cache/models/unload", json={"model": "b"}).json()["state"] == "unloaded"
    assert client.post("/v1/cache/models/load", json={"model": "nope"}).status_code == 404


def test_a_request_keep_alive_unloads_its_model_after_it_or_keeps_it(app_for):
    """Ollama's per-request keep_alive: 0 unloads the model once its request is done, a negative
    value keeps it loaded; a malformed one is a 422 before anything loads (and without [[models]]
    the field is checked the same way by the API's parser)."""
    import time

    client, registry = app_for(10**10)
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/completions", json=dict(body, keep_alive=-1)).status_code == 200
    assert states(client)["a"] == "loaded" and registry.keep_alive_s(registry.resolve("a")) == float("inf")
    assert client.post("/v1/completions", json=dict(body, keep_alive="0s")).status_code == 200
    deadline = time.monotonic() + 10
    while states(client)["a"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert states(client)["a"] == "unloaded"
    bad = client.post("/v1/completions", json=dict(body, model="b", keep_alive="soon"))
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "keep_alive"
    assert states(client)["b"] == "unloaded"
    assert client.post("/v1/completions", json=dict(body, keep_alive="10m")).status_code == 200
    assert registry.keep_alive_s(registry.resolve("a")) == 600.0


def test_keep_alive_values():
    from mlx_kvserve.errors import ValidationError
    from mlx_kvserve.server.keep_alive import parse_keep_alive

    assert parse_keep_alive(None) is None
    assert parse_keep_alive(30) == 30.0 and parse_keep_alive("1.5h") == 5400.0 and parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(-1) == float("inf") and parse_keep_alive("0") == 0.0
    for bad in ("later", True, [5], "5 minutes", float("nan")):
        with pytest.raises(ValidationError):
            parse_keep_alive(bad)
