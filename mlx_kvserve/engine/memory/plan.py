"""The memory plan: what the KV may take beside the weights on this device, decided once at start.

A pure function of three sets of facts, so it is tested with any Mac's figures injected:
- the device (`DeviceFacts`): the memory the arrays live in and the working set the server may use of
  it (Metal: MLX's recommended working set; CUDA: the GPU's memory; CPU: what is available at start);
- the model (`ModelFacts`): its weights' bytes, its KV bytes per token, its context;
- the explicit settings (`Settings`): [cache] ram_max_bytes, [server] kv_batch_bytes, 0 = planned.

The working set holds the weights, a reserve (a tenth of it, at least 512 MiB: activations, MLX's
buffer cache, the system's own use), the block cache's RAM budget (the KV kept for reuse) and the
batch's working set: the KV of the requests running together (engine/batch/kv_room.py) twice over, because
mlx-lm grows a cache (each prefill step, every 256 decoded tokens) and moves a prompt's cache into the
batch by copying it, old and new held at once (measured: a 128k-token prefill of 4 layers peaked at 2.1x
its KV, a 64k one of 32 layers at 1.24x: docs/benchmarks.md "Long contexts"). By default the cache gets
a third of what the weights and reserve leave (never more than a quarter of the memory, the old default)
and the batch the rest, no more than `max_batch` requests at the full context need. The largest context
is what the batch holds for one request. An explicit setting that does not fit is a ConfigError naming
the sum; so is a model whose weights leave no room for 256 tokens of KV.
Several models ([[models]]) share one plan (`registry_plan`): the reserve, the registry's budget for
their weights and KV caches, and one batch budget per model sum within the working set; each model
plans within the budget and its batch share (`DeviceFacts.share`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...errors import ConfigError
from ..batch.kv_room import STEP

GIB = 1024**3
MIN_RESERVE_BYTES = 512 * 1024**2
RESERVE_SHARE = 10  # a tenth of the working set stays out of the plan (activations, buffer cache, system)
GROWTH_COPIES = 2  # the batch's KV at its peak: a cache grown (or merged) by a copy, old and new at once
SOURCES = {
    "metal": "Metal's recommended working set",
    "cuda": "the GPU's memory",
    "cpu": "the memory available at start",
}


class DeviceFacts(NamedTuple):
    """`memory_bytes`: the memory the arrays live in (the system's; the GPU's own with CUDA).
    `working_set_bytes`: what the server may use of it. `is_share`: a registry's share of the working
    set, its reserve already set aside."""

    kind: str  # "metal", "cuda" or "cpu"
    memory_bytes: int
    working_set_bytes: int
    is_share: bool = False

    def share(self, budget_bytes: int) -> DeviceFacts:
        """These facts for one model of several, planned within the registry's `budget_bytes`."""
        return self._replace(working_set_bytes=budget_bytes, is_share=True)

    @property
    def source(self) -> str:
        return "the models' shared budget" if self.is_share else SOURCES.get(self.kind, "the working set")

    @property
    def reserve_bytes(self) -> int:
        return 0 if self.is_share else max(MIN_RESERVE_BYTES, self.working_set_bytes // RESERVE_SHARE)

    def describe(self) -> dict[str, Any]:
        """The device's part of /health's "memory_plan" object (one model's plan or the registry's)."""
        return {
            "device": self.kind,
            "memory_bytes": self.memory_bytes,
            "working_set_bytes": self.working_set_bytes,
            "working_set_source": self.source,
        }


class ModelFacts(NamedTuple):
    weights_bytes: int
    kv_bytes_per_token: int  # 0: unknown (the config names no attention shape): the batch is not bounded
    context_length: int  # the model's own, capped by [model] context_length


class Settings(NamedTuple):
    """The explicit settings the plan honours or refuses; 0 = the plan's."""

    ram_max_bytes: int = 0  # [cache] ram_max_bytes
    kv_batch_bytes: int = 0  # [server] kv_batch_bytes
    max_batch: int = 16  # [server] max_batch: the batch never needs more than this many full contexts
    cache_enabled: bool = True  # [cache] enabled: without the block cache its budget is 0

    @classmethod
    def of(cls, config: Any) -> Settings:
        server, cache = config.server, config.cache
        ram = cache.ram_max_bytes if cache.enabled else 0  # no block cache: its budget is moot
        return cls(ram, server.kv_batch_bytes, server.batch_limit(), cache.enabled)


@dataclass(frozen=True)
class MemoryPlan:
    device: DeviceFacts
    weights_bytes: int
    reserve_bytes: int
    kv_ram_bytes: int  # the block cache's RAM budget
    kv_batch_bytes: int  # the running requests' KV together (held GROWTH_COPIES times at its peak); 0 = no bound
    kv_bytes_per_token: int
    max_context: int  # the longest prompt + completion one request may hold

    @property
    def batch_peak_bytes(self) -> int:
        return GROWTH_COPIES * self.kv_batch_bytes

    @property
    def wired_limit_bytes(self) -> int:
        """What Metal should keep resident: the weights and the KV budgets, capped at the working set."""
        used = self.weights_bytes + self.kv_ram_bytes + self.batch_peak_bytes
        return min(self.device.working_set_bytes, used)

    def line(self) -> str:
        """The plan in one line, for the log at start."""
        return (
            f"memory plan ({self.device.kind}): {gib(self.device.working_set_bytes)} working set "
            f"({self.device.source}) = weights {gib(self.weights_bytes)} + KV cache {gib(self.kv_ram_bytes)} "
            f"+ batch KV {GROWTH_COPIES} x {gib(self.kv_batch_bytes)} + reserve {gib(self.reserve_bytes)}"
            f"{' + unplanned ' + gib(self.unplanned_bytes) if self.unplanned_bytes >= GIB // 100 else ''}; "
            f"{self.kv_bytes_per_token / 1024:.0f} KiB of KV per token; largest context {self.max_context} tokens"
        )

    @property
    def unplanned_bytes(self) -> int:
        return (
            self.device.working_set_bytes
            - self.weights_bytes
            - self.reserve_bytes
            - self.kv_ram_bytes
            - self.batch_peak_bytes
        )

    def describe(self) -> dict[str, Any]:
        """/health's "memory_plan" object."""
        return {
            **self.device.describe(),
            "weights_bytes": self.weights_bytes,
            "reserve_bytes": self.reserve_bytes,
            "kv_ram_bytes": self.kv_ram_bytes,
            "kv_batch_bytes": self.kv_batch_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_context": self.max_context,
            "wired_limit_bytes": self.wired_limit_bytes,
            "line": self.line(),
        }


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan(device: DeviceFacts, model: ModelFacts, settings: Settings) -> MemoryPlan:
    """The plan for `model` on `device` (see the module's docstring). ConfigError naming the numbers
    when an explicit setting does not fit beside the weights, or the weights leave no room for KV."""
    per_token, reserve = model.kv_bytes_per_token, device.reserve_bytes
    free = device.working_set_bytes - model.weights_bytes - reserve
    least_batch = STEP * per_token  # one step of one request: less serves nothing
    # The cache's default: a third of what is free, or all the explicit batch leaves; a quarter of the memory at most.
    explicit_peak = GROWTH_COPIES * settings.kv_batch_bytes
    rest = free - explicit_peak if explicit_peak else min(free // 3, free - GROWTH_COPIES * least_batch)
    ram = settings.ram_max_bytes or max(0, min(device.memory_bytes // 4, rest))
    if not settings.cache_enabled:
        ram = 0
    batch = settings.kv_batch_bytes
    if not batch and per_token:
        full = settings.max_batch * -(-model.context_length // STEP) * STEP * per_token
        batch = max(0, min((free - ram) // GROWTH_COPIES, full))
    parts = [
        ("the weights", model.weights_bytes),
        ("a reserve", reserve),
        ("cache.ram_max_bytes" if settings.ram_max_bytes else "the KV cache", ram),
        (
            f"{GROWTH_COPIES} x " + ("server.kv_batch_bytes" if settings.kv_batch_bytes else f"{STEP} tokens of KV"),
            GROWTH_COPIES * max(batch, least_batch),
        ),
    ]
    if sum(n for _, n in parts) > device.working_set_bytes:
        raise ConfigError(_refusal(device, parts, settings), param=_param(settings))
    context = model.context_length
    if batch and per_token:
        context = min(context, batch // per_token // STEP * STEP)
    return MemoryPlan(device, model.weights_bytes, reserve, ram, batch, per_token, context)


def _refusal(device: DeviceFacts, parts: list[tuple[str, int]], settings: Settings) -> str:
    total = sum(n for _, n in parts)
    terms = " + ".join(f"{name} {gib(n)}" for name, n in parts if n)
    advice = (
        "lower it, or set 0 to let the plan size it"
        if settings.ram_max_bytes or settings.kv_batch_bytes
        else "choose a smaller model or a lower-bit quantization"
    )
    return (
        f"memory plan: {terms} = {gib(total)} > the working set {gib(device.working_set_bytes)} "
        f"({device.source}); {advice}"
    )


def _param(settings: Settings) -> str:
    if settings.ram_max_bytes:
        return "cache.ram_max_bytes"
    return "server.kv_batch_bytes" if settings.kv_batch_bytes else "model.path"


class RegistryPlan(NamedTuple):
    """Several models' share of the working set: `models_bytes` ([server] model_memory_bytes) for their
    weights and KV caches (the registry unloads to stay within it), and `batch_bytes` for each model's
    batch, so that the reserve, the models' budget and every model's batch sum within the working set."""

    device: DeviceFacts
    models_bytes: int
    batch_bytes: int  # each model's [server] kv_batch_bytes (held GROWTH_COPIES times at its peak)
    num_models: int

    @property
    def batches_peak_bytes(self) -> int:
        return self.num_models * GROWTH_COPIES * self.batch_bytes

    @property
    def wired_limit_bytes(self) -> int:
        return min(self.device.working_set_bytes, self.models_bytes + self.batches_peak_bytes)

    def line(self) -> str:
        d = self.device
        return (
            f"memory plan ({d.kind}): {gib(d.working_set_bytes)} working set ({d.source}) = models "
            f"{gib(self.models_bytes)} (weights and KV caches) + {self.num_models} x batch KV {GROWTH_COPIES} x "
            f"{gib(self.batch_bytes)} "
            f"+ reserve {gib(d.reserve_bytes)}"
        )

    def describe(self) -> dict[str, Any]:
        return {
            **self.device.describe(),
            "reserve_bytes": self.device.reserve_bytes,
            "models_bytes": self.models_bytes,
            "kv_batch_bytes_per_model": self.batch_bytes,
            "wired_limit_bytes": self.wired_limit_bytes,
            "line": self.line(),
        }


def registry_plan(
    device: DeviceFacts, model_memory_bytes: int, kv_batch_bytes: int, num_models: int, lent: bool = False
) -> RegistryPlan:
    """The plan of `num_models` models: [server] model_memory_bytes as set, else half of the memory
    (the old default), at most two thirds of what the reserve leaves; each model's batch its own
    kv_batch_bytes, else an equal share of the rest (held twice at its peak, GROWTH_COPIES). ConfigError
    naming the sum when the explicit values do not fit. `lent`: a model's own process, whose parent
    planned both budgets (server/model_process.py): taken as they are, not checked again here."""
    if lent and model_memory_bytes and kv_batch_bytes:
        return RegistryPlan(device, model_memory_bytes, kv_batch_bytes, num_models)
    room = device.working_set_bytes - device.reserve_bytes
    models = model_memory_bytes or min(device.memory_bytes // 2, room * 2 // 3)
    batches = GROWTH_COPIES * kv_batch_bytes * num_models if kv_batch_bytes else room - models
    if models + batches > room or batches <= 0:
        terms = f"server.model_memory_bytes {gib(models)} + a reserve {gib(device.reserve_bytes)}"
        if kv_batch_bytes:
            terms += f" + {num_models} x {GROWTH_COPIES} x server.kv_batch_bytes {gib(kv_batch_bytes)}"
        raise ConfigError(
            f"memory plan: {terms} > the working set {gib(device.working_set_bytes)} ({device.source}); "
            f"the models' budget and their batches need to fit in {gib(room)}",
            param="server.model_memory_bytes" if model_memory_bytes else "server.kv_batch_bytes",
        )
    return RegistryPlan(device, models, kv_batch_bytes or batches // num_models // GROWTH_COPIES, num_models)


def planned_config(memory_plan: MemoryPlan, config: Any) -> Any:
    """`config` with the plan's budgets in place of the 0s it had ([cache] ram_max_bytes, [server]
    kv_batch_bytes), so everything built from it (block cache, admission, context cap) follows the plan."""
    cache = dataclasses.replace(config.cache, ram_max_bytes=memory_plan.kv_ram_bytes)
    server = dataclasses.replace(config.server, kv_batch_bytes=memory_plan.kv_batch_bytes)
    return dataclasses.replace(config, cache=cache, server=server)
