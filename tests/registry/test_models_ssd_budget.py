"""One SSD budget across the models of a server (issue 27): three tiny random-weight llamas behind one
app with a small `[ssd] max_bytes`, all loaded at once (their stores trim each other) or one at a time
(the folders of unloaded models are trimmed at rest, under their folder lock). The bytes on disk across
the three namespace folders stay within the budget after every request, the least recently used model
gives room first, a pinned prefix survives, a trimmed model's repeated prompt is answered as it was
cold, and /v1/models and /health report each model's SSD bytes."""

from __future__ import annotations

import pytest
import tinymodel
from mlx.utils import tree_flatten
from mlx_lm.utils import load
from starlette.testclient import TestClient

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.kv.ssd.format import block_relpath
from mlx_kvserve.model_entries import ModelEntry
from mlx_kvserve.registry.front import RoutedEngine
from mlx_kvserve.registry.registry import ModelRegistry
from mlx_kvserve.server.app import create_app

BS = 16


def prompt(seed: int) -> list[int]:
    return [(i * 37 + seed * 101) % 250 + 3 for i in range(4 * BS + 5)]  # 4 full blocks and a tail


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("three")
    return {
        "a": tiny_model_dir,
        "b": tinymodel.build_mlx_model(root / "wide", seed=1, hidden_size=96),
        "c": tinymodel.build_mlx_model(root / "other", seed=2),
    }


def start(
    folders, root, memory_bytes: int, ssd_max_bytes: int = 0, entry_bytes: int = 0
) -> tuple[TestClient, ModelRegistry]:
    overrides = {
        "server": {"model_memory_bytes": memory_bytes},
        "cache": {"block_size": BS},
        "ssd": {"cache_dir": str(root), "async_writes": False, "max_bytes": ssd_max_bytes},
    }
    entries = tuple(ModelEntry(name, str(folder), memory_bytes=entry_bytes) for name, folder in folders.items())
    registry = ModelRegistry(load_config(overrides=overrides), entries)
    client = TestClient(create_app(RoutedEngine(registry), ApiKeys("", ""), registry))
    client.__enter__()
    return client, registry


def complete(client: TestClient, model: str, tokens: list[int]) -> dict:
    body = {"model": model, "prompt": tokens, "max_tokens": 8, "temperature": 0}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def ssd_bytes(client: TestClient) -> dict[str, int | None]:
    return {card["id"]: card["ssd_bytes"] for card in client.get("/v1/models").json()["data"]}


def disk_bytes(root) -> int:
    """Block and tail files under the cache root (bookkeeping files aside)."""
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


@pytest.fixture(scope="module")
def cold(folders, tmp_path_factory):
    """Each model on a fresh cache without a budget: its greedy text for the prompts used below, and
    the bytes each prompt adds to its SSD folder (blocks and tail)."""
    root = tmp_path_factory.mktemp("cold")
    client, _ = start(folders, root / "kv", 2**30)
    texts, size = {}, {}
    for seed in (1, 2):
        was = ssd_bytes(client)
        for model in folders:
            texts[(model, seed)] = complete(client, model, prompt(seed))["choices"][0]["text"]
        size |= {(model, seed): n - (was[model] or 0) for model, n in ssd_bytes(client).items()}
    client.__exit__(None, None, None)
    return texts, size


def weights(folder) -> int:
    model, _ = load(str(folder))
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


@pytest.mark.parametrize("loaded", ["all", "one"])
def test_one_ssd_budget_across_three_models(folders, cold, tmp_path, monkeypatch, loaded):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    texts, size = cold
    budget = size[("a", 1)] + size[("b", 1)] + size[("c", 1)] + size[("a", 1)] // 4
    # "one": each model counted at 3 MiB in a 4 MiB budget, so one at a time (its KV cache planned within)
    memory, entry_bytes = (2**30, 0) if loaded == "all" else (4 * 2**20, 3 * 2**20)
    assert loaded == "all" or max(weights(f) for f in folders.values()) < 2**20
    client, registry = start(folders, tmp_path / "kv", memory, budget, entry_bytes)
    try:
        complete(client, "a", prompt(1))
        complete(client, "b", prompt(1))
        chain = registry.resolve("b").engine.cache_admin().block_hashes(prompt(1))
        pinned = client.post("/v1/cache/pin", json={"model": "b", "block_hashes": [chain[-1].hex()]})
        assert pinned.json()["pinned_count"] == 1
        complete(client, "c", prompt(1))
        before = ssd_bytes(client)
        assert before == {m: size[(m, 1)] for m in folders} and disk_bytes(tmp_path / "kv") <= budget

        complete(client, "c", prompt(2))  # room for c: a, the least recently used, gives it; b keeps all
        after = ssd_bytes(client)
        assert after["b"] == before["b"] and after["a"] < before["a"] and after["c"] == before["c"] + size[("c", 2)]
        assert disk_bytes(tmp_path / "kv") <= budget

        for seed in (3, 4, 5):  # more than a and b can give: b down to its pinned prefix, c evicts its own
            complete(client, "c", prompt(seed))
            assert disk_bytes(tmp_path / "kv") <= budget
        folder_b = registry.ssd.folders["b"]
        assert all((folder_b / block_relpath(h)).is_file() for h in chain)  # the pinned prefix survived
        assert ssd_bytes(client)["a"] == 0

        again = complete(client, "a", prompt(1))  # trimmed away: computed again, the same text
        assert again["choices"][0]["text"] == texts[("a", 1)]
        hit = complete(client, "b", prompt(1))
        assert hit["choices"][0]["text"] == texts[("b", 1)]
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BS
        assert disk_bytes(tmp_path / "kv") <= budget

        health = client.get("/health").json()
        assert health["ssd_budget_bytes"] == budget and health["ssd_used_bytes"] <= budget
        assert {row["id"]: row["ssd_bytes"] for row in health["models"]} == ssd_bytes(client)
        registry.ssd.budget.check_integrity()
    finally:
        client.__exit__(None, None, None)
