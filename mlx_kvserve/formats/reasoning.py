"""Reasoning text: the markers a thinking model writes its reasoning between (`<think>`/`</think>`,
whatever mlx-lm's TokenizerWrapper found for the model), and where a prompt leaves the reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def think_markers(tokenizer: Any) -> tuple[str, str] | None:
    """The (start, end) strings around the model's reasoning, or None for a model without them."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    return tokenizer.think_start, tokenizer.think_end


def reasoning_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """ "open": the prompt ends inside a reasoning block (a template that opens `<think>`);
    "closed": it ends right after one (a template that turns thinking off with an empty block);
    "free": the model may open one; "none": the model has no reasoning markers."""
    if not getattr(tokenizer, "has_thinking", False):
        return "none"
    opened, closed = tokenizer.rfind_think_start(prompt), tokenizer.rfind_think_end(prompt)
    if opened >= 0 and opened > closed:
        return "open"
    if closed >= 0 and not tokenizer.decode(list(prompt[closed + 1 :])).strip():
        return "closed"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and tokenizer.think_start not in template:
        return "none"  # markers in the vocabulary, but a template that never reasons (Qwen3-Coder)
    return "free"
