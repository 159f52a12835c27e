"""What Claude Code adds to an Anthropic Messages request beyond the conversation: `context_management`
edits, applied to the translated messages, and the billing line at the top of its system prompt,
removed before the prompt is rendered. Pure functions.

The billing line (`x-anthropic-billing-header: cc_version=…; cch=…;`) is for Anthropic's accounting;
several Claude Code versions put a per-request nonce in it, and as the first text of the prompt it
would make every request a new prefix, a full cache miss. The model never needs it.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError, ValidationError

BILLING_PREFIX = "x-anthropic-billing-header:"
CLEAR_THINKING = "clear_thinking_20251015"


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


def apply_context_management(raw: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` after the request's `context_management` edits. Raises InvalidRequestError (400)
    naming an edit type this server does not apply, ValidationError for a malformed one."""
    if raw is None:
        return messages
    edits = raw.get("edits", []) if isinstance(raw, dict) else None
    if not isinstance(edits, list) or set(raw) - {"edits"}:
        raise ValidationError("'context_management' must be {edits: [...]}", param="context_management")
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != CLEAR_THINKING:
            raise InvalidRequestError(
                f"{where}: edit type {kind!r} is not supported by this server (it applies {CLEAR_THINKING!r})",
                param="context_management",
            )
        if extra := sorted(set(edit) - {"type", "keep"}):
            raise InvalidRequestError(
                f"'{where}.{extra[0]}' is not supported by this server", param="context_management"
            )
        messages = clear_thinking(messages, _kept_turns(edit, where))
    return messages
