"""Constrained decoding with llguidance: a JSON schema (structured output) or a Lark grammar (tool
calls: engine/sampling/tool_grammar.py) becomes a per-request logits processor that masks every token the
grammar does not allow next.

A processor belongs to one request (its matcher follows that request's tokens) and runs inside
mlx-lm's batch: BatchGenerator calls it with the request's tokens so far (prompt included) and its
logits row. Once the schema is complete only end-of-sequence is allowed, so the request stops there.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import mlx.core as mx
import numpy as np

_LOCK = threading.Lock()
_BY_TOKENIZER: dict[int, Grammars] = {}


def grammars_for(tokenizer: Any) -> Grammars:
    """The one Grammars of this tokenizer (the HTTP side checks schemas with it, the worker runs
    them): built on first use."""
    with _LOCK:
        found = _BY_TOKENIZER.get(id(tokenizer))
        if found is None:
            found = _BY_TOKENIZER[id(tokenizer)] = Grammars(tokenizer)
        return found


class Grammars:
    """The tokenizer's llguidance view (built once: it scans the whole vocabulary), schema checks
    and processors."""

    def __init__(self, tokenizer: Any):
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer))
        self.vocab_size = self._tokenizer.vocab_size  # the width of its masks

    @staticmethod
    def _grammar(schema: dict[str, Any]) -> str:
        import llguidance

        # Compact JSON: with free whitespace a weak model can pad with blanks until max_tokens. A
        # schema that sets its own llguidance options ("x-guidance") keeps them.
        options = {"x-guidance": {"whitespace_flexible": False}} if "x-guidance" not in schema else {}
        return llguidance.grammar_from("json_schema", json.dumps({**schema, **options}))

    @staticmethod
    def _lark(text: str) -> str:
        import llguidance

        return llguidance.LLMatcher.grammar_from_lark(text)

    def _validate(self, build: Any, source: Any) -> str:
        import llguidance

        try:
            return llguidance.LLMatcher.validate_grammar(build(source), self._tokenizer)
        except Exception as exc:  # llguidance raises for input it cannot even parse
            return str(exc)

    def check(self, schema: dict[str, Any]) -> str:
        """Why this JSON schema cannot be enforced ("" when it can)."""
        return self._validate(self._grammar, schema)

    def check_lark(self, text: str) -> str:
        """Why this Lark grammar cannot be enforced ("" when it can)."""
        return self._validate(self._lark, text)

    def matcher(self, schema: dict[str, Any] | None = None, lark: str | None = None) -> Any:
        """A fresh llguidance matcher for `schema` (or the Lark grammar `lark`): one request's
        state (the speculative path checks drafts with it: engine/speculative/grammar.py)."""
        import llguidance

        return llguidance.LLMatcher(self._tokenizer, self._grammar(schema) if lark is None else self._lark(lark))

    def processor(self, schema: dict[str, Any] | None = None, lark: str | None = None, matcher: Any = None) -> Any:
        """A logits processor (tokens, logits) -> logits enforcing `schema` (or the Lark grammar
        `lark`) for one request; or continuing `matcher` (what it consumed counts as generated)."""
        return _SchemaProcessor(self._tokenizer, matcher if matcher is not None else self.matcher(schema, lark))


class _SchemaProcessor:
    def __init__(self, tokenizer: Any, matcher: Any):
        import llguidance.numpy

        self._matcher = matcher
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        self._vocab = tokenizer.vocab_size
        self._seen = -1  # tokens of the context already consumed (-1: not called yet)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        context = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if self._seen < 0:  # the first call sees the prompt: nothing generated yet
            self._seen = len(context)
        for token in context[self._seen :]:
            self._matcher.consume_token(int(token))
        self._seen = len(context)
        self._fill(self._matcher, self._mask, 0)
        allowed = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little")[: self._vocab].astype(bool)
        width = logits.shape[-1]
        keep = np.zeros(width, dtype=bool)
        keep[: min(width, self._vocab)] = allowed[:width]
        return mx.where(mx.array(keep), logits, -mx.inf)
