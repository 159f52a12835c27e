"""Reasoning effort as chat template variables, for both APIs (OpenAI `reasoning_effort`, Anthropic
`output_config.effort`). A template has two controls over thinking: `enable_thinking` (on or off;
mlx-lm maps it to the template's own name for the switch) and, in templates that take a level
(gpt-oss), `reasoning_effort`. A template that knows neither renders as before: effort is a hint there.
"""

from __future__ import annotations

from typing import Any

from ..errors import ValidationError

# The level each API's effort names in a template's terms (gpt-oss takes low / medium / high).
_LEVELS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_OFF = {"none", "minimal"}  # OpenAI's "no reasoning" and "as little as possible": thinking off


def parse_effort(value: Any, param: str) -> str | None:
    """`value` checked as an effort: None, or a string. An effort this server has no level for is a
    hint that changes nothing, not an error: the clients that send it cannot turn it off."""
    if value is None or isinstance(value, str):
        return value
    raise ValidationError(f"'{param}' must be a string, got {type(value).__name__}", param=param)


def effort_kwargs(effort: str | None, thinking: bool | None = None) -> dict[str, Any]:
    """Template variables for `effort`. `thinking` (Anthropic's `thinking` field) decides on or off
    when given; otherwise the effort does ("none" / "minimal" off, any other level on)."""
    out: dict[str, Any] = {}
    if thinking is not None:
        out["enable_thinking"] = thinking
    elif effort is not None and (effort in _OFF or effort in _LEVELS):
        out["enable_thinking"] = effort not in _OFF
    if effort in _LEVELS:
        out["reasoning_effort"] = _LEVELS[effort]
    return out
