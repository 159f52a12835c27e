"""What Claude Code adds to an Anthropic Messages request beyond the conversation: `context_management`
edits, applied to the translated messages, and the billing line at the top of its system prompt,
removed before the prompt is rendered. Pure functions.

`clear_tool_uses_20250919`, as Anthropic documents it: once the prompt passes `trigger` (100,000
input tokens by default, or a count of tool uses), the results of all but the latest `keep` tool uses
(3 by default) are replaced by PLACEHOLDER, oldest first, except those of `exclude_tools`; with
`clear_tool_inputs` (true, or a list of tool names) their inputs are emptied as well. `keep` counts
every tool use, excluded ones too. With `clear_at_least`, nothing is cleared unless the cleared text
holds at least that many tokens. Token thresholds are measured on a PromptSize (the prompt as
rendered without this edit); without one (the router's estimate) they are taken as not reached.

The billing line (`x-anthropic-billing-header: cc_version=…; cch=…;`) is for Anthropic's accounting;
several Claude Code versions put a per-request nonce in it, and as the first text of the prompt it
would make every request a new prefix, a full cache miss. The model never needs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from ...errors import InvalidRequestError, ValidationError

BILLING_PREFIX = "x-anthropic-billing-header:"
CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
EDITS = (CLEAR_THINKING, CLEAR_TOOL_USES)
PLACEHOLDER = "[cleared]"  # what a cleared tool result reads
TOOL_USE_FIELDS = {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
DEFAULT_TRIGGER = ("input_tokens", 100_000)
DEFAULT_KEEP = 3


class PromptSize(NamedTuple):
    """What clear_tool_uses measures its token thresholds with."""

    num_tokens: int  # the prompt's tokens, rendered without clear_tool_uses
    count: Callable[[str], int]  # the tokens of a text


def strip_billing_line(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`blocks` (the system prompt's text blocks) without a billing line at the start of the first
    one; a block that held only that line is dropped. Other blocks are the same objects."""
    if not blocks or not str(blocks[0].get("text", "")).startswith(BILLING_PREFIX):
        return blocks
    _, newline, rest = blocks[0]["text"].partition("\n")
    head = [{**blocks[0], "text": rest}] if newline and rest else []
    return head + blocks[1:]


def _kept_turns(edit: dict[str, Any], where: str) -> int | None:
    """How many of the latest assistant turns keep their thinking (None: all)."""
    keep = edit.get("keep", {"type": "thinking_turns", "value": 1})  # Anthropic's default
    if keep == "all":
        return None
    value = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValidationError(
            f'{where}.keep must be "all" or {{type: thinking_turns, value: N >= 1}}', param="context_management"
        )
    return value


def clear_thinking(messages: list[dict[str, Any]], keep: int | None) -> list[dict[str, Any]]:
    """`messages` (OpenAI's shape) with the reasoning of all but the latest `keep` assistant turns
    that have any dropped (None: all kept)."""
    if keep is None:
        return messages
    with_thinking = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("reasoning_content")]
    dropped = set(with_thinking[: max(0, len(with_thinking) - keep)])
    return [
        {k: v for k, v in m.items() if k != "reasoning_content"} if i in dropped else m for i, m in enumerate(messages)
    ]


def _amount(raw: Any, where: str, kinds: tuple[str, ...]) -> tuple[str, int] | None:
    """A `{type, value}` threshold of one of `kinds` (None when absent)."""
    if raw is None:
        return None
    value = raw.get("value") if isinstance(raw, dict) and raw.get("type") in kinds else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValidationError(
            f"{where} must be {{type: {' | '.join(kinds)}, value: N >= 0}}", param="context_management"
        )
    return raw["type"], value


def _names(raw: Any, where: str) -> set[str]:
    if not isinstance(raw, list) or not all(isinstance(name, str) for name in raw):
        raise ValidationError(f"{where} must be an array of tool names", param="context_management")
    return set(raw)


def clear_tool_uses(
    messages: list[dict[str, Any]], edit: dict[str, Any], where: str, size: PromptSize | None
) -> list[dict[str, Any]]:
    """`messages` (OpenAI's shape) after one clear_tool_uses edit (see the module's docstring)."""
    trigger = _amount(edit.get("trigger"), f"{where}.trigger", ("input_tokens", "tool_uses")) or DEFAULT_TRIGGER
    keep = _amount(edit.get("keep"), f"{where}.keep", ("tool_uses",))
    at_least = _amount(edit.get("clear_at_least"), f"{where}.clear_at_least", ("input_tokens",))
    exclude = _names(edit.get("exclude_tools", []), f"{where}.exclude_tools")
    inputs = edit.get("clear_tool_inputs", False)
    inputs = inputs if isinstance(inputs, bool) else _names(inputs, f"{where}.clear_tool_inputs")
    uses = [call for m in messages if m["role"] == "assistant" for call in m.get("tool_calls") or []]
    if trigger[0] == "tool_uses":
        triggered = len(uses) > trigger[1]
    else:
        triggered = size is not None and size.num_tokens > trigger[1]
    older = uses[: max(0, len(uses) - (DEFAULT_KEEP if keep is None else keep[1]))]
    cleared = {call["id"]: call for call in older if call["function"]["name"] not in exclude}
    if not triggered or not cleared:
        return messages
    freed: list[str] = []  # the text cleared, for clear_at_least
    out = []
    for m in messages:
        if m["role"] == "tool" and m.get("tool_call_id") in cleared and m["content"] != PLACEHOLDER:
            freed.append(m["content"])
            m = {**m, "content": PLACEHOLDER}
        elif m["role"] == "assistant" and inputs and any(c["id"] in cleared for c in m.get("tool_calls") or []):
            calls = []
            for call in m["tool_calls"]:
                fn = call["function"]
                if (
                    call["id"] in cleared
                    and (inputs is True or fn["name"] in inputs)
                    and fn["arguments"] not in ({}, "{}")
                ):
                    args = fn["arguments"]
                    freed.append(args if isinstance(args, str) else json.dumps(args))
                    call = {**call, "function": {**fn, "arguments": {}}}
                calls.append(call)
            m = {**m, "tool_calls": calls}
        out.append(m)
    if at_least is not None and (size is None or sum(map(size.count, freed)) < at_least[1]):
        return messages  # too little to clear: Anthropic leaves the prompt (and its cache) as it was
    return out


def measures_prompt(raw: Any) -> bool:
    """Whether the request's edits need a PromptSize (a clear_tool_uses edit)."""
    edits = raw.get("edits") if isinstance(raw, dict) else None
    return isinstance(edits, list) and any(isinstance(e, dict) and e.get("type") == CLEAR_TOOL_USES for e in edits)


def apply_context_management(
    raw: Any, messages: list[dict[str, Any]], size: PromptSize | None = None
) -> list[dict[str, Any]]:
    """`messages` after the request's `context_management` edits, in order. `size` measures
    clear_tool_uses' token thresholds (None: not reached). Raises InvalidRequestError (400) naming an
    edit type this server does not apply, ValidationError for a malformed one."""
    if raw is None:
        return messages
    edits = raw.get("edits", []) if isinstance(raw, dict) else None
    if not isinstance(edits, list) or set(raw) - {"edits"}:
        raise ValidationError("'context_management' must be {edits: [...]}", param="context_management")
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in EDITS:
            raise InvalidRequestError(
                f"{where}: edit type {kind!r} is not supported by this server (it applies {', '.join(EDITS)})",
                param="context_management",
            )
        known = {"type", "keep"} if kind == CLEAR_THINKING else TOOL_USE_FIELDS
        if extra := sorted(set(edit) - known):
            raise InvalidRequestError(
                f"'{where}.{extra[0]}' is not supported by this server", param="context_management"
            )
        if kind == CLEAR_THINKING:
            messages = clear_thinking(messages, _kept_turns(edit, where))
        else:
            messages = clear_tool_uses(messages, edit, where, size)
    return messages
