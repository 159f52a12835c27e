"""Where messages start in a chat prompt, from the tokens alone.

Hybrid and sliding-window models reuse a prefix only where a checkpoint was taken, so the
scheduler takes one where each new message starts: the prefix the next turn of the conversation,
or another question under the same system prompt, shares. The chat template opens every message
with the same special token (`<|im_start|>`, `<start_of_turn>`, `<|start_header_id|>` ...): it is
the first special token, other than BOS, in the rendering of one user message.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

MAX_MARKS = 4  # checkpoints at the last few message starts of a prompt's uncached part


def turn_start_token(tokenizer: Any) -> int | None:
    """The token that opens each message under the tokenizer's chat template, or None (no
    template, or it opens messages with plain text)."""
    exchange = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "z"},
    ]
    try:
        ids = list(tokenizer.apply_chat_template(exchange, add_generation_prompt=False))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        inner = getattr(tokenizer, "_tokenizer", None)
        added = getattr(inner, "added_tokens_decoder", None) or {}
        special |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    except Exception as exc:  # no template, or one that rejects this exchange
        log.info("no message-start token found in the chat template (%s)", exc)
        return None
    return next((t for t in ids if t in special and ids.count(t) >= 2), None)


def message_starts(prompt: Sequence[int], marker: int | None, after: int) -> list[int]:
    """Positions p > `after` where prompt[p] opens a message (the last MAX_MARKS of them)."""
    if marker is None:
        return []
    found = [p for p in range(max(after + 1, 1), len(prompt)) if prompt[p] == marker]
    return found[-MAX_MARKS:]
