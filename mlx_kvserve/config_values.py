"""Parsing one config value: byte sizes, a key's type, a failed check as ConfigError naming the key. A leaf under
config.py and model_entries.py (the `[[models]]` entries), so neither imports the other to share them."""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

__all__ = ["check", "coerce", "parse_bytes", "tomllib"]


def parse_bytes(value: int | str, key: str = "size") -> int:
    """Parse a byte size: an integer, or a string like "512MiB", "2GiB", "1.5GB", "4096"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte size, got {value!r}", param=key)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}", param=key)
        return value
    if not isinstance(value, str) or not (m := _SIZE_RE.match(value)):
        raise ConfigError(f"{key}: expected a byte size like 2GiB, got {value!r}", param=key)
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    binary = "I" in unit
    base = unit[:1] if unit not in ("", "B") else unit
    scale = 1024 ** "BKMGT".index(base) if binary else _SIZE_UNITS[base]
    return int(number * scale)


def coerce(section: str, key: str, value: Any, expected: type) -> Any:
    """`value` of `section.key` as the type `expected` (every *_bytes key a byte size); ConfigError naming the key."""
    name = f"{section}.{key}"
    if key.endswith("_bytes"):  # every *_bytes key is a byte size ("2GiB" or an integer)
        return parse_bytes(value, name)
    if getattr(expected, "__origin__", None) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings, got {value!r}", param=name)
        return list(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}", param=name)
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}: expected an integer, got {value!r}", param=name)
    if not isinstance(value, expected):
        raise ConfigError(f"{name}: expected {expected.__name__}, got {value!r}", param=name)
    return value


def check(ok: bool, key: str, message: str) -> None:
    """ConfigError `key: message` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}", param=key)
