"""`[[models]]`: the entries of the model registry (registry/registry.py; docs/models.md), read from the
config file apart from its sections (an array of tables, not a section of one table)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from .config_values import check as _check
from .config_values import coerce as _coerce
from .config_values import parse_bytes, tomllib
from .errors import ConfigError


@dataclass(frozen=True)
class ModelEntry:
    """One `[[models]]` entry of the registry (registry/registry.py; docs/models.md). Options left at 0 or
    "" take the server-wide value ([model], [cache], [server] model_keep_alive_s)."""

    name: str  # the id clients send and /v1/models lists
    source: str  # "default", a Hugging Face repo id, an MLX folder or a .gguf file
    aliases: tuple[str, ...] = ()  # other ids that name this model (e.g. "gpt-4o-mini")
    chat_template: str = ""
    dtype: str = ""  # for .gguf conversion; "" = model.dtype
    kv_bits: int = -1  # -1 = cache.kv_bits
    context_length: int = 0  # caps the model's context; 0 = the model's own
    ram_max_bytes: int = 0  # RAM budget of this model's block cache; 0 = cache.ram_max_bytes
    memory_bytes: int = 0  # what loading it costs, for the budget; 0 = measured (weights' size)
    preload: bool = False  # loaded at startup
    pinned: bool = False  # never unloaded
    keep_alive_s: float = -1.0  # unloaded after this long idle; 0 = only for room; -1 = server.model_keep_alive_s
    kind: str = "chat"  # "chat" (the completion APIs) or "embedding" (/v1/embeddings; engine/embedding.py)
    pooling: str = "last"  # embedding: "last" (the last token's state) or "mean" (of the input's tokens)
    normalize: bool = True  # embedding: L2-normalize each vector
    min_dimensions: int = 0  # embedding: the smallest `dimensions` a request may ask (Matryoshka); 0 = own size only
    process: bool = False  # served by a process of its own (server/model_process.py): fair beside other models


def _entry(i: int, raw: Any) -> ModelEntry:
    where = f"models[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table ([[models]])", param="models")
    hints = get_type_hints(ModelEntry)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key", param=f"{where}.{unknown[0]}")
    for key in ("name", "source"):
        _check(isinstance(raw.get(key), str) and bool(raw[key].strip()), f"{where}.{key}", "a non-empty string")
    values = dict(raw)
    if "aliases" in values:
        values["aliases"] = tuple(_coerce(where, "aliases", values["aliases"], list[str]))
    for key in ("ram_max_bytes", "memory_bytes"):
        if key in values:
            values[key] = parse_bytes(values[key], f"{where}.{key}")
    for key in set(values) - {"aliases", "ram_max_bytes", "memory_bytes"}:
        values[key] = _coerce(where, key, values[key], hints[key])
    entry = ModelEntry(**values)
    _check(entry.kv_bits in (-1, 0, 4, 8), f"{where}.kv_bits", "must be 0, 4 or 8")
    _check(entry.dtype in ("", "float32", "float16", "bfloat16", "keep"), f"{where}.dtype", "not a dtype")
    _check(entry.context_length >= 0, f"{where}.context_length", "must be >= 0")
    _check(entry.keep_alive_s >= 0 or entry.keep_alive_s == -1, f"{where}.keep_alive_s", "must be >= 0")
    _check(entry.kind in ("chat", "embedding"), f"{where}.kind", 'must be "chat" or "embedding"')
    _check(entry.pooling in ("last", "mean"), f"{where}.pooling", 'must be "last" or "mean"')
    _check(entry.min_dimensions >= 0, f"{where}.min_dimensions", "must be >= 0")
    return entry


def model_entries(raw: Any) -> tuple[ModelEntry, ...]:
    """The `[[models]]` array as entries; ConfigError naming `models[i].key` for a bad one, or a name
    (or alias) used twice."""
    if not isinstance(raw, list):
        raise ConfigError("models: expected an array of tables ([[models]])", param="models")
    entries = tuple(_entry(i, item) for i, item in enumerate(raw))
    seen: set[str] = set()
    for entry in entries:
        for name in (entry.name, *entry.aliases):
            _check(name not in seen and name != "default", "models", f"the id {name!r} names two models")
            seen.add(name)
    return entries


def load_model_entries(path: str | Path | None) -> tuple[ModelEntry, ...]:
    """The `[[models]]` entries of the config file at `path` (() without a file or entries)."""
    if path is None:
        return ()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:  # load_config reports these first
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    return model_entries(data.get("models", []))
