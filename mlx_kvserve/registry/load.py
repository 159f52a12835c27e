"""Loading and freeing one model of the registry (registry/registry.py): the entry's config, its Engine
(or, for `kind = "embedding"`, its EmbeddingEngine: engine/embedding.py) built and started on the calling
thread, and its memory given back when it is unloaded."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import sys
from pathlib import Path
from typing import Any, NamedTuple

from ..config import Config
from ..model_entries import ModelEntry


class Loaded(NamedTuple):
    """What a loader returns: the started engine and its weights' size in bytes."""

    engine: Any  # engine.Engine (or a test double with stop())
    weights_bytes: int


def entry_config(config: Config, entry: ModelEntry) -> Config:
    """The server's config with this entry's options in place ([model], [cache])."""
    model = dataclasses.replace(
        config.model,
        path=entry.source,
        served_name=entry.name,
        chat_template=entry.chat_template or config.model.chat_template,
        dtype=entry.dtype or config.model.dtype,
        context_length=entry.context_length,
    )
    cache = dataclasses.replace(
        config.cache,
        kv_bits=config.cache.kv_bits if entry.kv_bits < 0 else entry.kv_bits,
        ram_max_bytes=entry.ram_max_bytes or config.cache.ram_max_bytes,
    )
    return dataclasses.replace(config, model=model, cache=cache)


def load_engine(entry: ModelEntry, config: Config) -> Loaded:
    """Load the entry's model, build its Engine and start its worker (on the calling thread: MLX keeps
    a default stream per thread, and the weights are evaluated before the worker uses them)."""
    from mlx.utils import tree_flatten

    from ..engine.engine import Engine
    from ..engine.memory.plan import GROWTH_COPIES
    from ..models.loader import load_model

    cfg = entry_config(config, entry)
    loaded = load_model(cfg.model.path, cfg.models_path(), cfg.model.dtype, entry.name, None, cfg.model.chat_template)
    if entry.context_length:
        loaded.context_length = min(loaded.context_length, entry.context_length)
    weights = sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()))
    if entry.kind == "embedding":
        from ..engine.embedding import EmbeddingEngine

        engine: Any = EmbeddingEngine(loaded, cfg, entry.pooling, entry.normalize, entry.min_dimensions)
    else:  # planned within the models' budget and its batch share (the registry's plan)
        share = cfg.server.model_memory_bytes + GROWTH_COPIES * cfg.server.kv_batch_bytes
        engine = Engine(loaded, cfg, share_bytes=share)
    engine.start()
    return Loaded(engine, weights)


def free_engine(engine: Any, timeout: float) -> None:
    """Stop an engine (worker, SSD writer drain, folder lock) and give its memory back."""
    engine.stop(timeout)
    del engine
    gc.collect()  # the model's arrays are freed once nothing refers to them
    try:
        import mlx.core as mx

        mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back to the system
    except ImportError:  # pragma: no cover
        pass
    if sys.platform.startswith("linux"):  # glibc keeps freed heap pages: measured 438 -> 123 MiB RSS
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # another libc
            pass


def estimate_bytes(entry: ModelEntry) -> int:
    """What loading `entry` will cost before it was ever loaded: its safetensors files (0 when unknown)."""
    folder = Path(entry.source).expanduser()
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def kv_ram_bytes(engine: Any) -> int:
    """Bytes of KV blocks and tails `engine` holds in RAM now (0 while its cache is off); a model in
    a process of its own reports its process's (server/model_process.py)."""
    if callable(getattr(engine, "kv_ram_bytes", None)):
        return engine.kv_ram_bytes()
    manager = getattr(getattr(engine, "prefix_cache", None), "manager", None)
    if manager is None:
        return 0
    stats = manager.stats()
    return stats.get("kv_ram_bytes", 0) + stats.get("kv_tail_bytes", 0)
