"""The config file of a model's own process (server/model_process.py): this server's effective config
(file, environment and flags already applied) with the listener and the key of a loopback child and one
`[[models]]` entry, the model, pinned (the parent decides when it unloads) and loaded at start."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ..config import Config, as_dict, load_api_keys
from ..model_entries import ModelEntry


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def toml_table(header: str, values: dict[str, Any]) -> list[str]:
    return [header, *(f"{key} = {toml_value(v)}" for key, v in values.items() if v is not None), ""]


def child_config_text(config: Config, entry: ModelEntry, port: int, key: str) -> str:
    """The TOML of the child serving `entry` on 127.0.0.1:`port`, taking `key` (inference and admin)."""
    data = as_dict(config)
    data["server"] |= {"host": "127.0.0.1", "port": port, "api_key": key, "api_key_file": ""}
    data["server"] |= {"admin_api_key": "", "admin_api_key_file": ""}
    data["cache"]["pin_on_start"] = []  # the parent pins through the child's API (ModelProcess.pin_files)
    # The parent's keys decide, as for its own models: the child takes principals from the parent's header.
    keys = load_api_keys(config.server)
    data["cache"]["isolation"] = "per_key" if keys.isolated(config.cache.isolation) else "shared"
    whole_blocks = keys.whole_blocks(config.cache.isolation, config.cache.report_cached)
    data["cache"]["report_cached"] = "blocks" if whole_blocks else "exact"
    child = dataclasses.asdict(dataclasses.replace(entry, process=False, pinned=True, preload=True))
    lines: list[str] = []
    for section, values in data.items():
        lines += toml_table(f"[{section}]", values)
    return "\n".join(lines + toml_table("[[models]]", child))
