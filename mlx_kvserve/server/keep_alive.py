"""`keep_alive` (Ollama's): how long the model a request names stays loaded once idle. Served by the
model registry ([[models]], docs/models.md); a one-model server never unloads its model, so there
the field is checked and has nothing to change."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..errors import ValidationError

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's `keep_alive`: seconds (a number) or a duration ("30s", "10m", "1.5h"); 0 unloads the
    model once its requests are done; a negative value keeps it loaded however long it is idle
    (inf). None when absent. ValidationError (422) for anything else."""
    if value is None:
        return None
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
        if m:
            seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds is None or seconds != seconds:  # NaN
        raise ValidationError(
            "'keep_alive' must be seconds or a duration such as \"10m\" (0: unload after the request, "
            "negative: keep loaded)",
            param="keep_alive",
        )
    return math.inf if seconds < 0 else seconds


def requested_keep_alive(body: bytes) -> float | None:
    """The body's `keep_alive` (parse_keep_alive), None when absent or the body is not a JSON object."""
    try:
        data: Any = json.loads(body) if body.strip() else None
    except ValueError:
        return None
    return parse_keep_alive(data.get("keep_alive")) if isinstance(data, dict) else None
