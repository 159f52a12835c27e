"""The facts the memory plan (engine/memory/plan.py) is made from, read off this machine and the model.

The plan itself is pure; this is the one place that asks MLX and the system: the device's memory and
working set (Metal: MLX's recommended working set; CUDA: the GPU's memory; CPU: the memory available
now plus what this process's arrays already hold, so a model just loaded is not counted as missing),
the model's weights, its KV bytes per token and its context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from ..batch import kv_room
from .device import array_memory_bytes, arrays_in_device_memory, physical_memory_bytes
from .plan import DeviceFacts, MemoryPlan, ModelFacts, Settings, plan

MEMINFO = Path("/proc/meminfo")


def device_facts() -> DeviceFacts:
    """This machine's memory and the working set the server may use of it."""
    if mx.metal.is_available():
        info = mx.device_info()
        memory = int(info.get("memory_size") or physical_memory_bytes())
        return DeviceFacts("metal", memory, int(info.get("max_recommended_working_set_size") or memory * 3 // 4))
    if arrays_in_device_memory():
        memory = array_memory_bytes()
        return DeviceFacts("cuda", memory, memory)
    memory = physical_memory_bytes()
    return DeviceFacts("cpu", memory, min(memory, available_memory_bytes(memory) + mx.get_active_memory()))


def available_memory_bytes(default: int) -> int:
    """The system's MemAvailable (Linux), else `default`."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return default


def model_facts(loaded: Any, config: Any) -> ModelFacts:
    """The weights, KV bytes per token and context of `loaded` (a LoadedModel) under `config`."""
    from mlx.utils import tree_flatten

    weights = sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()))
    vlm = getattr(getattr(loaded, "vision", None), "vlm", None)  # a vision-language model's tower and projector
    for part in ("vision_tower", "multi_modal_projector"):
        module = getattr(vlm, part, None)
        if module is not None:
            weights += sum(a.nbytes for _, a in tree_flatten(module.parameters()))
    weights += draft_weights_bytes(config)
    per_token = kv_room.model_kv_bytes_per_token(loaded.model, loaded.config, config.cache.kv_bits)
    caps = [c for c in (loaded.context_length, config.model.context_length) if c]
    return ModelFacts(weights, per_token, min(caps, default=0))


def draft_weights_bytes(config: Any) -> int:
    """The weights of `[speculative] draft_model` (loaded beside the model once the plan is made:
    engine/speculative/draft.py), as their files' bytes (MLX loads them as stored); 0 without one, or
    when it cannot be found (loading it then fails with the reason)."""
    spec = config.speculative.draft_model
    if not spec:
        return 0
    from ...errors import KVServeError
    from ...models.loader import resolve_model_path

    try:
        _, path = resolve_model_path(spec, config.models_path(), config.model.dtype)
        return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    except (KVServeError, OSError):
        return 0


def plan_for(loaded: Any, config: Any, share_bytes: int = 0) -> MemoryPlan:
    """The plan of `loaded` on this machine; within `share_bytes` when it is one of several models
    (the registry's budget). ConfigError when a setting does not fit (memory_plan.plan)."""
    device = device_facts()
    if share_bytes:
        device = device.share(share_bytes)
    return plan(device, model_facts(loaded, config), Settings.of(config))
