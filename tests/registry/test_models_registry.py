"""The model registry's policy without a model (issue 27): ids and aliases, 404 naming the registered ids,
one load for concurrent first requests, LRU unloading under the memory budget, pinned and in-use models
never unloaded, keep_alive on a fake clock, the [[models]] config entries."""

from __future__ import annotations

import threading
import time

import pytest

from mlx_kvserve.config import load_config
from mlx_kvserve.errors import ConfigError, ModelLoadError, NotFoundError
from mlx_kvserve.model_entries import ModelEntry, load_model_entries, model_entries
from mlx_kvserve.registry.registry import LOADED, UNLOADED, Loaded, ModelRegistry, registry_entries

MiB = 2**20


class FakeEngine:
    def __init__(self, name: str):
        self.name, self.stopped = name, False

    def stop(self, timeout=None):
        self.stopped = True


class Loads:
    """A loader counting loads, each taking `delay` seconds; `fail` names models whose load raises."""

    def __init__(self, delay: float = 0.0, fail: frozenset[str] = frozenset()):
        self.delay, self.fail, self.count, self.lock = delay, fail, {}, threading.Lock()

    def __call__(self, entry: ModelEntry, config) -> Loaded:
        with self.lock:
            self.count[entry.name] = self.count.get(entry.name, 0) + 1
        time.sleep(self.delay)
        if entry.name in self.fail:
            raise ModelLoadError(f"cannot load {entry.name}")
        return Loaded(FakeEngine(entry.name), entry.memory_bytes)


def registry(*entries: ModelEntry, budget: int = 10 * MiB, loads: Loads | None = None, **kw) -> ModelRegistry:
    config = load_config(overrides={"server": {"model_memory_bytes": budget}})
    return ModelRegistry(config, entries, loader=loads or Loads(), unloader=lambda e, t: e.stop(t), **kw)


A = ModelEntry("a", "src-a", aliases=("gpt-4o",), memory_bytes=6 * MiB)
B = ModelEntry("b", "src-b", memory_bytes=6 * MiB)
C = ModelEntry("c", "src-c", memory_bytes=3 * MiB)


def states(reg: ModelRegistry) -> dict[str, str]:
    return {slot.entry.name: slot.state for slot in reg.slots}


def test_ids_aliases_and_default_resolve_and_others_are_a_404_naming_the_registered():
    reg = registry(A, B)
    assert reg.resolve("gpt-4o") is reg.resolve("a") is reg.resolve(None) is reg.resolve("default")
    assert reg.resolve("b").entry is B
    with pytest.raises(NotFoundError) as err:
        reg.resolve("claude-sonnet-4-5")
    assert err.value.code == "model_not_found" and "'a', 'b'" in err.value.message


def test_a_load_that_does_not_fit_unloads_the_least_recently_used_idle_model():
    reg = registry(A, B, C)
    reg.acquire("a").release()
    reg.acquire("c").release()  # a (6) + c (3) fit 10
    assert states(reg) == {"a": LOADED, "b": UNLOADED, "c": LOADED}
    a_engine = reg.resolve("a").engine
    reg.acquire("b").release()  # 6 more: a, the least recently used, goes
    assert states(reg) == {"a": UNLOADED, "b": LOADED, "c": LOADED} and a_engine.stopped
    assert reg.describe()["memory_used_bytes"] == 9 * MiB


def test_a_model_in_use_is_never_unloaded_the_load_waits_for_its_release():
    reg = registry(A, B)
    held = reg.acquire("a")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(reg.acquire("b")))
    waiter.start()
    time.sleep(0.3)
    assert states(reg) == {"a": LOADED, "b": UNLOADED} and not got  # b waits: a is in use
    held.release()
    waiter.join(5)
    assert states(reg) == {"a": UNLOADED, "b": LOADED} and got


def test_pinned_models_stay_and_a_model_then_loads_over_the_budget():
    reg = registry(ModelEntry("a", "s", pinned=True, memory_bytes=6 * MiB), B)
    reg.start()  # pinned ones load at start
    assert states(reg)["a"] == LOADED
    reg.acquire("b").release()
    assert states(reg) == {"a": LOADED, "b": LOADED}  # nothing could go: over the budget, logged


def test_eight_concurrent_first_requests_trigger_one_load():
    loads = Loads(delay=0.3)
    reg = registry(A, loads=loads)
    leases, barrier = [], threading.Barrier(8)

    def first():
        barrier.wait()
        leases.append(reg.acquire("gpt-4o"))

    threads = [threading.Thread(target=first) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert loads.count == {"a": 1} and len(leases) == 8
    assert reg.resolve("a").in_use == 8
    assert len({id(lease.engine) for lease in leases}) == 1


def test_a_failed_load_fails_every_request_waiting_for_it():
    reg = registry(A, loads=Loads(delay=0.3, fail=frozenset({"a"})))
    errors: list[Exception] = []

    def first():
        try:
            reg.acquire("a")
        except ModelLoadError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 4 and states(reg) == {"a": UNLOADED} and "cannot load a" in reg.resolve("a").error


def test_keep_alive_unloads_an_idle_model_on_the_clock():
    now = [0.0]
    reg = registry(ModelEntry("a", "s", keep_alive_s=60.0), B, clock=lambda: now[0])
    lease = reg.acquire("a")
    now[0] = 500.0
    assert reg.reap_idle() == []  # in use
    lease.release()
    now[0] = 530.0
    assert reg.reap_idle() == []
    now[0] = 561.0
    assert reg.reap_idle() == ["a"] and states(reg)["a"] == UNLOADED


def test_admin_unload_refuses_a_model_in_use():
    from mlx_kvserve.errors import ConflictError

    reg = registry(A)
    lease = reg.acquire("a")
    with pytest.raises(ConflictError):
        reg.unload("a")
    lease.release()
    assert reg.unload("a")["state"] == UNLOADED and reg.load("a")["state"] == LOADED


def test_the_run_flag_picks_the_default_model():
    entries = (A, B)
    assert registry_entries(entries, None) == entries
    assert registry_entries(entries, "b")[0] is B and registry_entries(entries, "gpt-4o")[0] is A
    assert registry_entries(entries, "org/other")[0] == ModelEntry("org/other", "org/other")


def test_models_entries_in_the_config_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[server]\nmodel_memory_bytes = "8GiB"\n\n[[models]]\nname = "small"\nsource = "default"\n'
        'aliases = ["gpt-4o-mini"]\npreload = true\n\n[[models]]\nname = "coder"\nsource = "org/coder"\n'
        'memory_bytes = "2GiB"\nkeep_alive_s = 300\n'
    )
    assert load_config(path).server.model_memory_bytes == 8 * 2**30
    small, coder = load_model_entries(path)
    assert small.aliases == ("gpt-4o-mini",) and small.preload
    assert coder.memory_bytes == 2 * 2**30 and coder.keep_alive_s == 300.0
    for bad, key in (
        ([{"name": "a"}], "models[0].source"),
        ([{"name": "a", "source": "s", "pinned": "yes"}], "models[0].pinned"),
        ([{"name": "a", "source": "s"}, {"name": "b", "source": "s", "aliases": ["a"]}], "models"),
    ):
        with pytest.raises(ConfigError) as err:
            model_entries(bad)
        assert err.value.param == key
