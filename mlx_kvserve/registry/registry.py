"""The model registry: several models behind one server, each an Engine of its own (its model, its
block cache in its own namespace, its SSD folder lock, its worker thread), loaded when a request names
it and unloaded least-recently-used when the memory budget needs room, or after its keep-alive.

Contract:
- `resolve(name)` maps a model id, an alias, "default", "" or None (the default model: the first entry)
  to its slot; NotFoundError (404) naming the registered ids for anything else.
- `acquire(name)` blocks until the model is loaded and returns a Lease; while any lease on a model is
  held ("in use") the model is never unloaded. Concurrent acquires of an unloaded model share one load;
  when it fails, each of them raises its error. OverloadedError (429) when no room can be made within
  `wait_s` because the other models are in use; ShuttingDownError after `stop`.
- Room: before a load, loaded models that are idle (no lease) and not pinned are unloaded, least
  recently used first, until the loaded models' footprints (weights + their KV blocks in RAM) plus the
  new one's fit `[server] model_memory_bytes`. When waiting cannot help (the rest is pinned), the model
  loads over the budget (logged).
- Unloading stops the engine: its worker ends, its SSD writer drains (under `evict_only` the blocks still
  in RAM are written first), its folder lock goes; a later load finds those blocks on the SSD.
- SSD: with `[ssd] max_bytes`, the models' namespace folders share that one budget (registry/ssd_share.py):
  a model's store that needs room trims the least recently used models' folders first, loaded or not,
  never below their pinned blocks. Without [[models]] (`single`) the one folder has it to itself. A
  model in a process of its own (`process = true`) is lent a share (RegistrySSD.lend) that its process,
  a `single` registry, keeps its folder within.
- One lock (`_cond`) guards every slot's state, leases and counters; loads and unloads run outside it,
  and so does every call into the SSD budget (which may trim folders).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..engine.batch.step_turns import StepTurns, share_turns
from ..engine.memory import device as device_memory
from ..engine.memory.facts import device_facts
from ..engine.memory.plan import registry_plan
from ..errors import ModelLoadError, OverloadedError, ShuttingDownError, model_not_found
from ..model_entries import ModelEntry
from .load import Loaded, estimate_bytes, free_engine, kv_ram_bytes, load_engine
from .ssd_share import RegistrySSD, engine_store

log = logging.getLogger(__name__)

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
REAP_INTERVAL_S = 1.0  # how often idle models are checked against their keep_alive


@dataclass
class ModelSlot:
    """One registered model and its state; every field is guarded by ModelRegistry._cond."""

    entry: ModelEntry
    state: str = UNLOADED
    engine: Any = None
    in_use: int = 0  # leases held
    last_used: float = 0.0  # clock() at the last acquire or release
    weights_bytes: int = 0  # measured at its last load (0 before the first)
    context_length: int = 0  # the context it served at its last load (0 before the first)
    num_loads: int = 0
    num_unloads: int = 0
    load_s: float = 0.0  # how long its last load took
    error: str = ""  # why its last load failed ("" when it did not)
    failures: int = 0  # failed loads, so that waiters on a load can tell it failed
    # The last request's keep_alive (Ollama's, in seconds; inf: never unloaded for idleness; 0: unloaded
    # once its requests are done); None: the entry's keep_alive_s.
    keep_alive_request: float | None = None


class Lease:
    """A model held for one request: `engine` serves it; `release()` (idempotent) lets it go."""

    def __init__(self, registry: ModelRegistry, slot: ModelSlot):
        self._registry, self.slot, self.engine = registry, slot, slot.engine
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self.slot)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ModelRegistry:
    """The registered models (see the module's contract). `single`: the one-model server of
    `run --model M` (no [[models]]): ids other than its own and "default" stay a 404, as before."""

    def __init__(
        self,
        config: Config,
        entries: tuple[ModelEntry, ...],
        single: bool = False,
        loader: Callable[[ModelEntry, Config], Loaded] = load_engine,
        unloader: Callable[[Any, float], None] = free_engine,
        clock: Callable[[], float] = time.monotonic,
        wait_s: float = 300.0,
    ):
        if not entries:
            raise ValueError("a registry needs at least one model")
        self.config, self.single = config, single
        self.slots = [ModelSlot(e) for e in entries]
        self._ids = {name: slot for slot in self.slots for name in (slot.entry.name, *slot.entry.aliases)}
        self._loader, self._unloader, self._clock, self._wait_s = loader, unloader, clock, wait_s
        # One memory plan for all (engine/memory/plan.py): ConfigError when the explicit budgets do not fit.
        server = config.server
        budgets = (server.model_memory_bytes, server.kv_batch_bytes, len(entries))
        self.plan = registry_plan(device_facts(), *budgets, lent=single)  # single: a model's process, its parent's
        self.budget_bytes = self.plan.models_bytes
        if not single:
            log.info("%s", self.plan.line())
        # What each model's engine plans within: the models' budget, and its batch share (registry/load.py).
        planned = dataclasses.replace(
            server, model_memory_bytes=self.budget_bytes, kv_batch_bytes=self.plan.batch_bytes
        )
        self._model_config = dataclasses.replace(config, server=planned)
        self._cond = threading.Condition()  # guards every slot's fields and _closing
        self._closing = False
        self._reaper: threading.Thread | None = None
        self.ssd = None if single else RegistrySSD.for_config(config)  # the shared SSD budget, if any
        # Turns for the loaded engines' batch steps (engine/batch/step_turns.py). None, the default: each engine
        # steps when ready, which measured fairer than turns on the CPU and the GPU (docs/models.md).
        self.turns: StepTurns | None = None

    @property
    def default(self) -> ModelSlot:
        return self.slots[0]

    @property
    def names(self) -> list[str]:
        return [slot.entry.name for slot in self.slots]

    def resolve(self, name: str | None) -> ModelSlot:
        if name in (None, "", "default"):
            return self.default
        slot = self._ids.get(name)  # type: ignore[arg-type]
        if slot is None:
            raise model_not_found(name, list(self.names))
        return slot

    def keep_alive_s(self, slot: ModelSlot) -> float:
        if slot.keep_alive_request is not None:
            return slot.keep_alive_request
        ka = slot.entry.keep_alive_s
        return self.config.server.model_keep_alive_s if ka < 0 else ka

    # --- leases ---------------------------------------------------------------------------------

    def acquire(self, name: str | None) -> Lease:
        """The named model, loaded if needed (this thread loads it, or waits for the load under way)."""
        slot = self.resolve(name)
        deadline = self._clock() + self._wait_s
        lease: Lease | None = None
        with self._cond:
            failures = slot.failures
            while True:
                if self._closing:
                    raise ShuttingDownError("server is shutting down")
                if slot.failures != failures:  # the load this request waited for failed
                    raise ModelLoadError(f"model {slot.entry.name!r} failed to load: {slot.error}")
                if slot.state == LOADED:
                    lease = self._lease(slot)
                    break
                victims = self._room_for(slot) if slot.state == UNLOADED else None
                if victims is not None:
                    slot.state = LOADING
                    for victim in victims:
                        victim.state = UNLOADING
                    break
                left = deadline - self._clock()
                if left <= 0:
                    busy = [s.entry.name for s in self.slots if s.in_use]
                    raise OverloadedError(f"no room to load {slot.entry.name!r}: in use now: {busy}; retry shortly")
                self._cond.wait(min(left, 1.0))
        if lease is None:
            for victim in victims:
                self._unload(victim)
            lease = self._load(slot)
        if self.ssd is not None:
            self.ssd.used(slot.entry.name)  # the LRU order of the SSD budget
        return lease

    def _lease(self, slot: ModelSlot) -> Lease:
        slot.in_use += 1
        slot.last_used = self._clock()
        return Lease(self, slot)

    def _release(self, slot: ModelSlot) -> None:
        with self._cond:
            slot.in_use -= 1
            slot.last_used = self._clock()
            self._cond.notify_all()

    def _load(self, slot: ModelSlot) -> Lease:
        started = time.monotonic()
        config, lent = self._model_config, self.ssd is not None and slot.entry.process
        if self.ssd is not None:
            self.ssd.hold(slot.entry.name)  # no trim of its folder while its engine takes the lock
            if lent:  # a process of its own budgets its folder alone, within the share lent it
                config = self.ssd.lend(slot.entry.name, config, len(self.slots))
        try:
            loaded = self._loader(slot.entry, config)
        except Exception as exc:
            if self.ssd is not None:
                self.ssd.hold(slot.entry.name, False)
                if lent:
                    self.ssd.returned(slot.entry.name)
            with self._cond:
                slot.state, slot.error = UNLOADED, str(getattr(exc, "message", "") or exc)
                slot.failures += 1
                self._cond.notify_all()
            raise
        if self.ssd is not None:
            self.ssd.loaded(slot.entry.name, loaded.engine)  # its store's cap, before a request writes
        share_turns(loaded.engine, self.turns)
        with self._cond:
            slot.engine, slot.weights_bytes, slot.state, slot.error = loaded.engine, loaded.weights_bytes, LOADED, ""
            slot.context_length = int(getattr(loaded.engine, "context_length", 0) or 0)
            slot.num_loads += 1
            slot.load_s = time.monotonic() - started
            lease = self._lease(slot)
            self._cond.notify_all()
        log.info(
            "model %s loaded in %.2fs (%.1f MiB of weights)", slot.entry.name, slot.load_s, slot.weights_bytes / 2**20
        )
        return lease

    # --- memory ---------------------------------------------------------------------------------

    def footprint(self, slot: ModelSlot) -> int:
        """What `slot` costs now (lock held): its weights and its KV in RAM while loaded; the
        estimate while it loads; 0 unloaded."""
        if slot.state == UNLOADED:
            return 0
        estimate = slot.entry.memory_bytes or slot.weights_bytes or estimate_bytes(slot.entry)
        if slot.state == LOADING or slot.engine is None:
            return estimate
        return (slot.entry.memory_bytes or slot.weights_bytes) + kv_ram_bytes(slot.engine)

    def _room_for(self, slot: ModelSlot) -> list[ModelSlot] | None:
        """The idle models to unload so that `slot` fits (least recently used first), or None when the
        room can only come from models in use or loading: wait for them (lock held)."""
        need = slot.entry.memory_bytes or slot.weights_bytes or estimate_bytes(slot.entry)
        others = [s for s in self.slots if s is not slot and s.state != UNLOADED]
        used = sum(self.footprint(s) for s in others)
        idle = sorted(
            (s for s in others if s.state == LOADED and s.in_use == 0 and not s.entry.pinned),
            key=lambda s: s.last_used,
        )
        victims: list[ModelSlot] = []
        while used + need > self.budget_bytes and idle:
            victim = idle.pop(0)
            used -= self.footprint(victim)
            victims.append(victim)
        if used + need <= self.budget_bytes:
            return victims
        if any(s.in_use or s.state in (LOADING, UNLOADING) for s in others if s not in victims):
            return None  # room will come when they are released or done
        log.warning(
            "model %s loads over the memory budget (%.1f MiB): the rest is pinned",
            slot.entry.name,
            self.budget_bytes / 2**20,
        )
        return victims

    def _unload(self, slot: ModelSlot) -> None:
        """Stop the engine of a slot marked UNLOADING (outside the lock)."""
        engine = slot.engine
        log.info("unloading model %s (idle since %.1fs)", slot.entry.name, self._clock() - slot.last_used)
        if self.ssd is not None:
            self.ssd.hold(slot.entry.name)  # its drain may still write
        try:
            self._unloader(engine, self.config.server.shutdown_timeout_s)
        finally:
            if self.ssd is not None:
                self.ssd.unloaded(slot.entry.name)
                if slot.entry.process:
                    self.ssd.returned(slot.entry.name)
            with self._cond:
                slot.engine, slot.state = None, UNLOADED
                slot.num_unloads += 1
                self._cond.notify_all()

    # --- admin ----------------------------------------------------------------------------------

    def load(self, name: str) -> dict[str, Any]:
        """Load `name` (if needed) now; its row of describe()."""
        with self.acquire(name) as lease:
            return self.describe_slot(lease.slot)

    def unload(self, name: str) -> dict[str, Any]:
        """Unload `name` now. ConflictError (409) while a request uses it or it is loading."""
        from ..errors import ConflictError

        slot = self.resolve(name)
        with self._cond:
            if slot.state == LOADED and slot.in_use:
                raise ConflictError(f"model {slot.entry.name!r} is in use by {slot.in_use} requests", param="model")
            if slot.state in (LOADING, UNLOADING):
                raise ConflictError(f"model {slot.entry.name!r} is {slot.state}; retry shortly", param="model")
            go = slot.state == LOADED
            if go:
                slot.state = UNLOADING
        if go:
            self._unload(slot)
        return self.describe_slot(slot)

    def reap_idle(self) -> list[str]:
        """Unload the models idle past their keep_alive; their names."""
        now = self._clock()
        with self._cond:
            due = [
                s
                for s in self.slots
                if s.state == LOADED
                and not s.in_use
                and not s.entry.pinned
                and (s.keep_alive_request == 0 or 0 < self.keep_alive_s(s) < now - s.last_used)
            ]
            for slot in due:
                slot.state = UNLOADING
        for slot in due:
            self._unload(slot)
        return [s.entry.name for s in due]

    def set_keep_alive(self, slot: ModelSlot, seconds: float) -> None:
        """A request's keep_alive for its model (Ollama's): from now on `slot` is unloaded after
        `seconds` idle (0: as soon as no request uses it; inf: never for idleness), until the next
        request that names one. Unloads happen on the reaper thread."""
        with self._cond:
            slot.keep_alive_request = seconds
        self._start_reaper()

    # --- life -----------------------------------------------------------------------------------

    def adopt(self, slot: ModelSlot, engine: Any, weights_bytes: int) -> None:
        """`engine` (started by the caller) serves `slot` from now on."""
        with self._cond:
            slot.engine, slot.weights_bytes, slot.state = engine, weights_bytes, LOADED
            slot.context_length = int(getattr(engine, "context_length", 0) or 0)
            slot.num_loads += 1
            slot.last_used = self._clock()
        if self.ssd is not None:
            self.ssd.loaded(slot.entry.name, engine)
        share_turns(engine, self.turns)

    def start(self) -> None:
        """Set Metal's wired limit to the plan's (put back by stop()), load the models marked `preload`
        (or pinned) and start the keep-alive reaper."""
        if not self.single:  # a model's own process: its parent's plan
            device_memory.wire(self.plan.wired_limit_bytes)
        for slot in self.slots:
            if (slot.entry.preload or slot.entry.pinned) and slot.state == UNLOADED:
                self.acquire(slot.entry.name).release()
        if any(self.keep_alive_s(s) > 0 for s in self.slots):
            self._start_reaper()

    def _start_reaper(self) -> None:
        with self._cond:
            if self._reaper is not None or self._closing:
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="model-reaper", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        while True:
            with self._cond:
                if self._closing:
                    return
                self._cond.wait(REAP_INTERVAL_S)
            try:
                self.reap_idle()
            except Exception:  # a failed unload is logged; the reaper goes on
                log.exception("unloading an idle model failed")

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new leases, then stop every loaded engine (their requests are cancelled)."""
        with self._cond:
            self._closing = True
            loaded = [s for s in self.slots if s.state == LOADED]
            for slot in loaded:
                slot.state = UNLOADING
            self._cond.notify_all()
        for slot in loaded:
            slot.engine.stop(timeout)
            with self._cond:
                slot.engine, slot.state = None, UNLOADED
        if not self.single:
            device_memory.unwire()

    def loaded_engines(self) -> list[tuple[str, Any]]:
        with self._cond:
            return [(s.entry.name, s.engine) for s in self.slots if s.state == LOADED]

    def ssd_bytes(self, slot: ModelSlot) -> int | None:
        """The bytes of `slot`'s SSD folder: its store's while loaded, the shared budget's record
        while not; None when unknown (never loaded, no SSD tier). Not under `_cond`."""
        if callable(getattr(slot.engine, "ssd_bytes", None)):  # a model in a process of its own
            return slot.engine.ssd_bytes()
        if self.ssd is not None:
            return self.ssd.bytes_of(slot.entry.name)
        store = engine_store(slot.engine)
        return store.usage().used_bytes if store is not None else None

    def describe_slot(self, slot: ModelSlot) -> dict[str, Any]:
        ssd_bytes = self.ssd_bytes(slot)
        with self._cond:
            return {
                "id": slot.entry.name,
                "aliases": list(slot.entry.aliases),
                "kind": slot.entry.kind,
                "state": slot.state,
                "pinned": slot.entry.pinned,
                "in_use": slot.in_use,
                "memory_bytes": self.footprint(slot),
                "ssd_bytes": ssd_bytes,
                "weights_bytes": slot.weights_bytes,
                "context_length": slot.context_length or slot.entry.context_length or None,  # None: not known yet
                "keep_alive_s": self.keep_alive_s(slot),
                "idle_s": round(self._clock() - slot.last_used, 1) if slot.state == LOADED else None,
                "loads": slot.num_loads,
                "unloads": slot.num_unloads,
                "load_s": round(slot.load_s, 3),
                "error": slot.error,
                "process": slot.engine.process_info() if callable(getattr(slot.engine, "process_info", None)) else None,
            }

    def describe(self) -> dict[str, Any]:
        """Every model's row and the budget, for /health, /v1/models and the admin API."""
        rows = [self.describe_slot(slot) for slot in self.slots]
        used = sum(r["memory_bytes"] for r in rows)
        out = {"memory_budget_bytes": self.budget_bytes, "memory_used_bytes": used, "models": rows}
        out["memory_plan"] = self.plan.describe()
        return out | (self.ssd.budget.describe() if self.ssd is not None else {})


def registry_entries(entries: tuple[ModelEntry, ...], model_flag: str | None) -> tuple[ModelEntry, ...]:
    """The [[models]] entries with `run --model M` first (the default model): M names an entry (or an
    alias), or M is a source served under its own name ahead of the entries."""
    if not model_flag:
        return entries
    for i, entry in enumerate(entries):
        if model_flag in (entry.name, *entry.aliases):
            return (entry, *entries[:i], *entries[i + 1 :])
    return (ModelEntry(served_name(model_flag), model_flag), *entries)


def served_name(source: str) -> str:
    """The id a model source is served under (as models/loader.py names it), without loading it."""
    from ..models.default import DEFAULT_MODEL_NAME

    if source == "default":
        return DEFAULT_MODEL_NAME
    path = Path(source).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name if path.is_dir() else source)
