"""`logprobs` / `top_logprobs` in OpenAI's shapes, from the engine's per-token TokenLogprob.

Chat: `logprobs: true` (+ `top_logprobs: 0..20`) gives `choice.logprobs = {"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}`. Completions (the legacy API): `logprobs: 0..20` is the
number of alternatives and gives `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
Streamed chunks carry the entries of the tokens behind them in the same shapes.

Under constrained decoding (response_format, forced tool calls) the tokens the grammar masks out have a
logprob of -inf, which is not a JSON number. As OpenAI does, impossible alternatives are left out of
`top_logprobs` (a token may list fewer than asked), and a sampled token's own logprob, were it ever not
finite, is reported as LOGPROB_FLOOR.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...engine.request import TokenLogprob
from ...errors import ValidationError

MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of (next to) no probability


class LogprobRequest(NamedTuple):
    enabled: bool
    num_top: int  # alternatives per token


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValidationError(f"'{name}' must be an integer between 0 and {MAX_TOP_LOGPROBS}", param=name)
    return value


def parse_logprobs(body: dict[str, Any], kind: str) -> LogprobRequest:
    """The request's logprob fields; ValidationError (422) naming a bad one."""
    if kind != "chat":  # completions: `logprobs` is the number of alternatives (0 = the sampled token only)
        num = _int_field(body, "logprobs")
        return LogprobRequest(num is not None, num or 0)
    enabled = body.get("logprobs")
    if enabled is not None and not isinstance(enabled, bool):
        raise ValidationError("'logprobs' must be a boolean", param="logprobs")
    num_top = _int_field(body, "top_logprobs")
    if num_top and not enabled:
        raise ValidationError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return LogprobRequest(bool(enabled), num_top or 0)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _possible(top: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The alternatives that could have been sampled: a masked token's -inf (or a NaN) is left out."""
    return [(token, logprob) for token, logprob in top if math.isfinite(logprob)]


class LogprobFormatter:
    """Turns TokenLogprob entries into OpenAI's logprob objects for one reply."""

    def __init__(self, tokenizer: Any, kind: str):
        self.tokenizer = tokenizer
        self.kind = kind
        self._text_offset = 0  # completions: where the next token's text starts in the reply

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _chat_entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    def block(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """The `logprobs` object of a choice (whole reply or one chunk); None when there are none."""
        if not entries:
            return None
        if self.kind == "chat":
            content = []
            for e in entries:
                item = self._chat_entry(e.token, e.logprob)
                item["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in _possible(e.top)]
                content.append(item)
            return {"content": content}
        tokens, offsets = [], []
        for e in entries:
            text = self._text(e.token)
            tokens.append(text)
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{self._text(t): lp for t, lp in _possible(e.top)} for e in entries],
            "text_offset": offsets,
        }
