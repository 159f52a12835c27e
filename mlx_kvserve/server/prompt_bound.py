"""A prompt far past the context window, refused from its text's size before the tokenizer runs.

A 3 MB body is tokenized on an HTTP thread (seconds, and gigabytes of the tokenizer's buffers) only to be
refused for its length. No token of a tokenizer stands for more bytes of text than its vocabulary's
longest entry, so a prompt needs at least `text bytes / that length` tokens: past the window by that
count, it cannot fit, whatever the tokenizer would say. The bound holds only for tokenizers that never
drop or shrink text before they split it (a byte-level or byte-fallback BPE, no normalizer but NFC or
a space marker): for any other `max_token_bytes` is None and every prompt is tokenized, as before.
Only text the chat template surely renders is counted: the user messages' (stripped: templates trim).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from . import context_window as cw
from .openai import parse as oa

log = logging.getLogger(__name__)
# How many bytes of text a normalizer may turn into one byte: NFC composes at most three (Hangul jamo,
# three bytes each, into one three-byte syllable; a letter and a two-byte accent into two bytes).
_NFC_SHRINK = 3
_KEPT_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}  # split, never drop


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many bytes of text may become one byte under `normalizer` (1: none); None when it may
    drop text (strip, lowercase, accents, whitespace) or its effect is not known."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            each = _shrink(part)
            if each is None:
                return None
            factor *= each
        return factor
    if kind == "NFC":
        return _NFC_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":  # Llama's " " -> "▁": a string pattern replaced by as many bytes or more
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "")
        return 1 if isinstance(pattern, str) and pattern and len(content.encode()) >= len(pattern.encode()) else None
    return None


def _keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _KEPT_PRE_TOKENIZERS and pre.get("behavior", "Isolated") != "Removed"


@functools.lru_cache(maxsize=16)
def max_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of prompt text one token of `tokenizer` (mlx-lm's wrapper or a transformers
    tokenizer) may stand for, or None when no such bound holds (see the module's docstring). Computed
    once per tokenizer (its vocabulary: ~0.1 s for 150k entries)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers'; mlx-lm's wrapper holds one
    backend = backend or getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        model = spec.get("model") or {}
        pre = spec.get("pre_tokenizer")
        byte_level = "ByteLevel" in json.dumps(pre)
        if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
            return None  # an unknown token could stand for any length of text
        shrink = _shrink(spec.get("normalizer"))
        if shrink is None or not _keeps_text(pre):
            return None
        added = {t["content"] for t in spec.get("added_tokens") or []}
        # A byte-level vocabulary spells each byte as one character; added tokens match raw text.
        longest = max(
            len(t.encode()) if t in added or not byte_level else len(t)
            for t in backend.get_vocab(with_added_tokens=True)
        )
        return longest * shrink
    except Exception as exc:  # an unusual tokenizer file: no bound, every prompt tokenized as before
        log.warning("no size bound for prompts of this tokenizer: %s", exc)
        return None


def counted_text(req: oa.CompletionRequest, truncate: bool) -> str | None:
    """The prompt text a lower bound may count: a text prompt whole, a chat's user messages (with
    `truncate`, the newest turn's only: older turns may be dropped to fit). None when nothing is
    counted (token ids, images, whose marks the template replaces)."""
    if req.images:
        return None
    if req.kind != "chat":
        return req.prompt if isinstance(req.prompt, str) else None
    messages = req.messages or []
    if truncate:
        cuts = cw.cut_points(messages)
        if len(cuts) >= 2:
            messages = messages[cuts[-1] :]
    return "".join(
        m["content"].strip() for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)
    )


def min_prompt_tokens(req: oa.CompletionRequest, per_token: int | None, truncate: bool) -> int:
    """The fewest tokens `req`'s prompt can have, from its text's size (0 when no bound holds)."""
    if not per_token:
        return 0
    text = counted_text(req, truncate)
    return len(text.encode("utf-8", "surrogatepass")) // per_token if text else 0


def check_size(req: oa.CompletionRequest, tokenizer: Any, win: cw.Window, truncate: bool) -> None:
    """ContextLengthError (in the API's words, with the bound as the count) when `req`'s text alone
    needs more tokens than `win` holds; nothing else, and never for a prompt that could fit."""
    fewest = min_prompt_tokens(req, max_token_bytes(tokenizer), truncate)
    if fewest > win.max_prompt:
        raise cw.ContextLengthError(fewest, win, req.kind)
