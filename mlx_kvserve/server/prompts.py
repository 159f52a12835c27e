"""Prompt tokenization for the HTTP routes (completions and cache pins alike): the tokenizer and the
chat template run in a thread, and whatever they refuse becomes a 400 naming the field, never a 500."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from ..engine.front import EngineFront
from ..errors import InvalidRequestError, ValidationError
from .gate import PRINCIPAL
from .messages import merge_system_turns

MAX_TOKEN_ID = 2**31  # bound on token ids when the model's config names no vocab_size


async def chat_tokens(
    engine: EngineFront,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` (with `tools` and `template_kwargs`) under the chat template. System
    messages after the first turn are rendered in place where the template takes them, else merged
    into a user turn (merge_system_turns). InvalidRequestError when the template (or the tokenizer)
    rejects the messages."""
    args = (add_generation_prompt, tools, template_kwargs, PRINCIPAL.get())  # the token memo's namespace
    try:
        return await run_in_threadpool(engine.chat_tokens, messages, *args)
    except Exception as exc:  # jinja raises its own types for templates that reject input
        merged = merge_system_turns(messages)
        if merged is not messages:
            with contextlib.suppress(Exception):
                return await run_in_threadpool(engine.chat_tokens, merged, *args)
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from None


async def chat_text(
    engine: EngineFront, messages: list[dict[str, Any]], tools: list | None, template_kwargs: Any
) -> str | None:
    """The text chat_tokens encodes for these messages (ready for the assistant's turn), when the token
    memo encodes it (None otherwise, or when the template rejects it), with chat_tokens' fallback."""
    try:
        return await run_in_threadpool(engine.chat_text, messages, tools, template_kwargs)
    except Exception:  # as chat_tokens: a template that takes no system turn past the first
        merged = merge_system_turns(messages)
        if merged is not messages:
            with contextlib.suppress(Exception):
                return await run_in_threadpool(engine.chat_text, merged, tools, template_kwargs)
        return None


async def text_tokens(engine: EngineFront, prompt: str) -> list[int]:
    """Token ids of `prompt`. InvalidRequestError when the tokenizer refuses it."""
    try:
        return await run_in_threadpool(engine.text_tokens, prompt)
    except Exception as exc:  # tokenizers raise their own types
        raise InvalidRequestError(f"the prompt could not be tokenized: {exc}", param="prompt") from None


def check_token_ids(engine: EngineFront, tokens: Sequence[int]) -> None:
    """ValidationError (422) unless every id is in [0, vocab_size)."""
    vocab = engine.vocab_size or MAX_TOKEN_ID
    if any(not 0 <= t < vocab for t in tokens):
        raise ValidationError(f"token ids in 'prompt' must be in [0, {vocab})", param="prompt")
