"""The memory plan (engine/memory/plan.py): its arithmetic for a 16 / 32 / 64 / 128 GB Mac serving
Qwen3 4B / 8B / 30B-A3B at 4 bits (device facts injected: Metal's recommended working set as MLX
reports it on those Macs), explicit settings refused with the numbers, several models within one
budget; and an engine built on it (its budgets, its context, /health, Metal's wired limit)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.utils import load
from starlette.testclient import TestClient

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.batch import kv_room
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.memory import device as device_memory
from mlx_kvserve.engine.memory import facts as memory_facts
from mlx_kvserve.engine.memory.plan import DeviceFacts, ModelFacts, Settings, plan, planned_config, registry_plan
from mlx_kvserve.engine.speculative import draft as draft_module
from mlx_kvserve.errors import ConfigError
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

GIB = 1024**3
# max_recommended_working_set_size on Apple silicon Macs of 16, 32, 64 and 128 GB.
MACS = {16: 11453251584, 32: 22906503168, 64: 51539607552, 128: 103079215104}
# From the models' config.json: layers, KV heads, head_dim (keys and values at 2 bytes each).
QWEN3 = {
    "4B": ({"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}, 2.3e9),
    "8B": ({"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}, 4.6e9),
    "30B": ({"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}, 17e9),
}
CONTEXT = 40960  # the three models' max_position_embeddings


def mac(gb: int) -> DeviceFacts:
    return DeviceFacts("metal", gb * GIB, MACS[gb])


def qwen3(size: str) -> ModelFacts:
    config, weights = QWEN3[size]
    return ModelFacts(int(weights), kv_room.kv_bytes_per_token(config, 2), CONTEXT)


def test_kv_bytes_per_token_of_the_qwen3_models():
    assert [qwen3(s).kv_bytes_per_token for s in QWEN3] == [144 * 1024, 144 * 1024, 96 * 1024]


# (Mac, model) -> (KV cache GiB, batch KV GiB, largest context), None: refused.
EXPECTED = {
    (16, "4B"): (2.49, 2.49, 17920),
    (16, "8B"): (1.77, 1.77, 12800),
    (16, "30B"): None,  # 15.83 GiB of weights past a 10.67 GiB working set
    (32, "4B"): (5.69, 5.69, CONTEXT),
    (32, "8B"): (4.97, 4.97, 36096),
    (32, "30B"): (1.12, 1.12, 12032),
    (64, "4B"): (13.69, 13.69, CONTEXT),
    (64, "8B"): (12.97, 12.97, CONTEXT),
    (64, "30B"): (9.12, 9.12, CONTEXT),
    (128, "4B"): (28.09, 28.09, CONTEXT),
    (128, "8B"): (27.37, 27.37, CONTEXT),
    (128, "30B"): (23.52, 23.52, CONTEXT),
}


@pytest.mark.parametrize(("gb", "size"), list(EXPECTED))
def test_the_plan_for_each_mac_and_model(gb, size):
    device, model, expected = mac(gb), qwen3(size), EXPECTED[(gb, size)]
    if expected is None:
        with pytest.raises(ConfigError) as refused:
            plan(device, model, Settings())
        assert "the weights 15.83 GiB + a reserve 1.07 GiB" in refused.value.message
        assert "> the working set 10.67 GiB (Metal's recommended working set)" in refused.value.message
        return
    p = plan(device, model, Settings())
    assert (round(p.kv_ram_bytes / GIB, 2), round(p.kv_batch_bytes / GIB, 2), p.max_context) == expected
    assert p.reserve_bytes == MACS[gb] // 10
    # the batch's KV counted twice: mlx-lm grows and merges caches by copying them
    assert p.weights_bytes + p.reserve_bytes + p.kv_ram_bytes + 2 * p.kv_batch_bytes <= MACS[gb]
    # the largest context is what the batch holds for one request, in whole 256-token steps
    assert p.max_context == min(CONTEXT, p.kv_batch_bytes // model.kv_bytes_per_token // 256 * 256)
    assert p.wired_limit_bytes == min(MACS[gb], p.weights_bytes + p.kv_ram_bytes + 2 * p.kv_batch_bytes)
    assert f"largest context {p.max_context} tokens" in p.line() and p.describe()["max_context"] == p.max_context


def test_explicit_settings_that_do_not_fit_are_refused_naming_the_numbers():
    with pytest.raises(ConfigError) as refused:
        plan(mac(16), qwen3("8B"), Settings(ram_max_bytes=8 * GIB))
    assert refused.value.param == "cache.ram_max_bytes"
    assert refused.value.message == (
        "memory plan: the weights 4.28 GiB + a reserve 1.07 GiB + cache.ram_max_bytes 8.00 GiB + 2 x 256 tokens of "
        "KV 0.07 GiB = 13.42 GiB > the working set 10.67 GiB (Metal's recommended working set); lower it, or set 0 "
        "to let the plan size it"
    )
    with pytest.raises(ConfigError, match=r"2 x server.kv_batch_bytes 6.00 GiB = 11.85 GiB > the working set 10.67"):
        plan(mac(16), qwen3("8B"), Settings(ram_max_bytes=GIB // 2, kv_batch_bytes=3 * GIB))


def test_an_explicit_setting_that_fits_is_kept_and_the_rest_planned_around_it():
    p = plan(mac(16), qwen3("8B"), Settings(ram_max_bytes=GIB))
    assert p.kv_ram_bytes == GIB and p.kv_batch_bytes == (MACS[16] - int(4.6e9) - MACS[16] // 10 - GIB) // 2
    p = plan(mac(16), qwen3("8B"), Settings(kv_batch_bytes=2 * GIB))
    assert p.kv_batch_bytes == 2 * GIB and p.max_context == 2 * GIB // (144 * 1024) // 256 * 256 == 14336


def test_the_batch_never_takes_more_than_max_batch_full_contexts():
    p = plan(mac(128), qwen3("4B"), Settings(max_batch=2))
    assert p.kv_batch_bytes == 2 * CONTEXT * 144 * 1024 and p.max_context == CONTEXT
    assert p.wired_limit_bytes == p.weights_bytes + p.kv_ram_bytes + 2 * p.kv_batch_bytes < MACS[128]


def test_without_the_block_cache_the_batch_has_the_room():
    p = plan(mac(16), qwen3("8B"), Settings(cache_enabled=False))
    assert p.kv_ram_bytes == 0 and p.kv_batch_bytes == (MACS[16] - int(4.6e9) - MACS[16] // 10) // 2


def test_a_model_with_no_kv_estimate_leaves_the_batch_unbounded():
    p = plan(mac(16), ModelFacts(int(4.6e9), 0, CONTEXT), Settings())
    assert p.kv_batch_bytes == 0 and p.max_context == CONTEXT


def test_several_models_share_one_plan():
    device = mac(32)  # a 21.33 GiB working set, 2.13 GiB of it the reserve
    reg = registry_plan(device, 0, 0, 2)
    room = MACS[32] - MACS[32] // 10
    assert reg.models_bytes == room * 2 // 3  # under half of the memory (16 GiB): a third left for batches
    assert reg.batch_bytes == (room - reg.models_bytes) // 2 // 2  # each model's batch, held twice at its peak
    assert registry_plan(device, 8 * GIB, 0, 2).batch_bytes == (room - 8 * GIB) // 4
    with pytest.raises(ConfigError, match=r"server.model_memory_bytes 30.00 GiB \+ a reserve 2.13 GiB > the work"):
        registry_plan(device, 30 * GIB, 0, 2)
    with pytest.raises(ConfigError, match=r"12.00 GiB \+ a reserve 2.13 GiB \+ 2 x 2 x server.kv_batch_bytes 2.00 GiB"):
        registry_plan(device, 12 * GIB, 2 * GIB, 2)
    # each model plans within the models' budget and its batch: weights + cache within the budget
    share = device.share(reg.models_bytes + 2 * reg.batch_bytes)
    for size in ("4B", "8B"):
        p = plan(share, qwen3(size), Settings(kv_batch_bytes=reg.batch_bytes))
        assert p.reserve_bytes == 0 and p.kv_batch_bytes == reg.batch_bytes
        assert p.weights_bytes + p.kv_ram_bytes <= reg.models_bytes
    assert "the models' shared budget" in p.line()
    # the reserve, the models' budget and both batches within the working set
    assert device.reserve_bytes + reg.models_bytes + 2 * 2 * reg.batch_bytes <= MACS[32]


def test_the_planned_config_carries_the_budgets():
    p = plan(mac(32), qwen3("8B"), Settings())
    config = planned_config(p, load_config())
    assert config.cache.ram_max_bytes == p.kv_ram_bytes and config.server.kv_batch_bytes == p.kv_batch_bytes


def test_metal_wired_limit_set_then_restored(monkeypatch):
    calls: list[int] = []
    limits = iter([7 * GIB, 0, 0, 0])  # what set_wired_limit returns: the limit before
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n) or next(limits))
    device_memory.wire(9 * GIB)
    device_memory.rewire()  # after mlx-lm's BatchGenerator wired the recommended size
    device_memory.unwire()
    assert calls == [9 * GIB, 9 * GIB, 7 * GIB]
    device_memory.rewire()  # nothing planned any more
    assert calls == [9 * GIB, 9 * GIB, 7 * GIB]


@pytest.mark.skipif(mx.metal.is_available(), reason="off Metal only")
def test_no_wired_limit_off_metal(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n) or 0)
    device_memory.wire(9 * GIB)
    device_memory.unwire()
    assert calls == []


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir), return_config=True)


def engine_on(device: DeviceFacts, tiny, tiny_model_dir, monkeypatch, **overrides) -> Engine:
    monkeypatch.setattr(memory_facts, "device_facts", lambda: device)
    model, tokenizer, config = tiny
    loaded = LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048)
    return Engine(loaded, load_config(overrides={"ssd": {"enabled": False}} | overrides))


def test_an_engine_follows_its_plan(tiny, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    per_token = kv_room.model_kv_bytes_per_token(tiny[0], tiny[2])
    weights = memory_facts.model_facts(LoadedModel("t", tiny_model_dir, tiny[0], tiny[1], tiny[2], 2048), load_config())
    # a device whose working set leaves 1536 tokens of KV past the weights and the reserve
    device = DeviceFacts("cpu", 64 * GIB, weights.weights_bytes + 512 * 1024**2 + 1536 * per_token)
    wired: list[int] = []
    monkeypatch.setattr(device_memory, "wire", wired.append)
    engine = engine_on(device, tiny, tiny_model_dir, monkeypatch)
    p = engine.memory_plan
    assert (p.kv_ram_bytes, p.kv_batch_bytes) == (512 * per_token, 512 * per_token)  # a third, a third twice
    assert engine.context_length == p.max_context == 512
    assert engine.kv_room.budget_bytes == p.kv_batch_bytes
    assert engine.prefix_cache.manager.stats()["kv_ram_max_bytes"] == p.kv_ram_bytes - p.kv_ram_bytes // 8
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        body = client.get("/health").json()
        assert body["memory_plan"]["kv_batch_bytes"] == 512 * per_token and body["memory_plan"]["max_context"] == 512
        assert body["memory_plan"]["line"] == p.line()
    assert wired == [p.wired_limit_bytes]  # started: the plan's limit (a no-op off Metal)


def test_the_plan_counts_a_draft_models_weights(tiny, tiny_model_dir, tmp_path):
    """[speculative] draft_model is loaded beside the model after the plan is made: its weights are in
    the plan's, or the KV budgets would take the memory they occupy."""
    loaded = LoadedModel("t", tiny_model_dir, tiny[0], tiny[1], tiny[2], 2048)
    plain = memory_facts.model_facts(loaded, load_config()).weights_bytes
    files = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    drafted = load_config(overrides={"speculative": {"mode": "draft", "draft_model": str(tiny_model_dir)}})
    assert memory_facts.model_facts(loaded, drafted).weights_bytes == plain + files > plain
    missing = load_config(overrides={"speculative": {"mode": "draft", "draft_model": str(tmp_path / "none")}})
    assert memory_facts.model_facts(loaded, missing).weights_bytes == plain  # loading it says why, later


def test_a_draft_models_block_cache_is_inside_the_plans_kv_budget(tiny, tiny_model_dir, tmp_path, monkeypatch):
    """The draft's prompt KV cache (speculative/draft.py) takes its share of the planned KV budget: the
    served model's blocks and the draft's together hold what the plan gives the KV cache, not 1.125x."""
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    speculative = {"mode": "draft", "draft_model": str(tiny_model_dir)}
    engine = engine_on(
        DeviceFacts("cpu", 64 * GIB, 4 * GIB), tiny, tiny_model_dir, monkeypatch, speculative=speculative
    )
    total = engine.memory_plan.kv_ram_bytes
    served, draft = engine.prefix_cache.manager, engine.speculation.draft.prefix_cache.manager
    share = total // (draft_module.RAM_SHARE + 1)
    assert served.stats()["kv_ram_max_bytes"] == (total - share) - (total - share) // 8
    assert draft.stats()["kv_ram_max_bytes"] == share - share // 8
    assert served._tails.max_bytes + served._ram.max_bytes + draft._tails.max_bytes + draft._ram.max_bytes == total
    engine.stop()


def test_an_engine_refuses_an_explicit_budget_past_the_working_set(tiny, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"cache.ram_max_bytes 32.00 GiB .* > the working set 16.00 GiB"):
        engine_on(
            DeviceFacts("cpu", 64 * GIB, 16 * GIB), tiny, tiny_model_dir, monkeypatch, cache={"ram_max_bytes": "32GiB"}
        )


def test_a_registry_plans_its_models_together(monkeypatch):
    from mlx_kvserve.model_entries import ModelEntry
    from mlx_kvserve.registry.registry import ModelRegistry

    monkeypatch.setattr("mlx_kvserve.registry.registry.device_facts", lambda: mac(32))
    entries = (ModelEntry("a", "src-a"), ModelEntry("b", "src-b"))
    reg = ModelRegistry(load_config(), entries, loader=lambda e, c: None)
    expected = registry_plan(mac(32), 0, 0, 2)
    assert reg.budget_bytes == expected.models_bytes and reg.describe()["memory_plan"]["line"] == expected.line()
    # what each model's engine plans within (registry/load.py): the models' budget and its batch share
    assert reg._model_config.server.model_memory_bytes == expected.models_bytes
    assert reg._model_config.server.kv_batch_bytes == expected.batch_bytes
    with pytest.raises(ConfigError, match="server.model_memory_bytes 64.00 GiB"):
        ModelRegistry(load_config(overrides={"server": {"model_memory_bytes": "64GiB"}}), entries)


def test_the_server_refuses_to_start_naming_the_numbers(tiny_model_dir, tmp_path):
    """`mlx-kvserve run` with a KV budget past this machine's memory: exit 1, the sum in the message."""
    import os
    import subprocess
    import sys

    config = tmp_path / "config.toml"
    config.write_text('[cache]\nram_max_bytes = "1024GiB"\n[ssd]\nenabled = false\n')
    env = os.environ | {"MLX_KVSERVE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--config", str(config), "--model", str(tiny_model_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "memory plan: the weights" in done.stderr and "cache.ram_max_bytes 1024.00 GiB" in done.stderr
    assert "> the working set" in done.stderr
