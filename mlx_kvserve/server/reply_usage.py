"""The token counts of a reply relayed from a model's own process (server/model_proxy.py), read from
the reply itself, so this server's request log and /metrics count them as for a model served here.

Contract:
- `ReplyUsage(record, content_type)` is fed the reply's body chunks in order (`feed`) and `close()`d
  at its end; it fills `record`'s prompt, cached and completion tokens from the last usage the reply
  carries, and its first-token time at the first event that carries generated output.
- Usage shapes: OpenAI (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`),
  the Responses API (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`, under
  `response`), Anthropic (`input_tokens` + `cache_read_input_tokens` + `cache_creation_input_tokens`
  the prompt, `output_tokens`, under `message` in `message_start`).
- A stream asked with USAGE_HEADER (the proxy sends it) ends with one more SSE comment line,
  `: usage {"prompt_tokens", "cached_tokens", "completion_tokens"}` (`usage_comment`, written by
  sse.GenerationStream): exact counts for every stream, also those that carry no usage of their own
  (OpenAI's without `stream_options.include_usage`). Clients skip comment lines, as they skip keep-alives.
- A JSON reply is read whole (up to MAX_JSON_BYTES; a larger one is relayed uncounted); a stream line by
  line. Nothing it reads changes the bytes relayed, and a reply it cannot parse leaves the record as it was.
"""

from __future__ import annotations

import json
from typing import Any

from .metrics import RequestRecord

MAX_JSON_BYTES = 16 * 2**20
USAGE_HEADER = b"x-mlx-kvserve-usage"  # asks a stream for its closing usage comment (ASGI: lowercase bytes)
USAGE_COMMENT = b": usage "
OUTPUT_EVENTS = ("content_block_delta", "response.output_text.delta", "response.function_call_arguments.delta")


class ReplyUsage:
    def __init__(self, record: RequestRecord | None, content_type: str):
        self.record = record
        self.stream = content_type.startswith("text/event-stream")
        self.is_json = content_type.startswith("application/json")
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        if self.record is None:
            return
        if self.stream:
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    self._event(line[5:].strip())
                elif line.startswith(USAGE_COMMENT):
                    counts = _parsed(line[len(USAGE_COMMENT) :])
                    if isinstance(counts, dict):
                        _count(self.record, counts)
        elif self.is_json and len(self._buffer) + len(chunk) <= MAX_JSON_BYTES:
            self._buffer += chunk
        else:
            self.is_json = False  # too large to count: relayed as it is
            self._buffer = b""

    def close(self) -> None:
        if self.record is None:
            return
        self.record.stream = self.stream
        if self.is_json and self._buffer:
            body = _parsed(self._buffer)
            if isinstance(body, dict):
                self._take_usage(body)
        self._buffer = b""

    def _event(self, data: bytes) -> None:
        event = _parsed(data)
        if not isinstance(event, dict):
            return
        if _carries_output(event):
            self.record.mark_first_token()
        self._take_usage(event)

    def _take_usage(self, body: dict[str, Any]) -> None:
        usage = body.get("usage")
        for outer in ("message", "response"):  # Anthropic's message_start, the Responses API's events
            if not isinstance(usage, dict) and isinstance(body.get(outer), dict):
                usage = body[outer].get("usage")
        if isinstance(usage, dict):
            _count(self.record, usage)


def usage_comment(record: RequestRecord) -> bytes:
    """The closing comment of a stream asked with USAGE_HEADER: the request's token counts."""
    counts = {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens}
    counts["prompt_tokens_details"] = {"cached_tokens": record.cached_tokens}
    return USAGE_COMMENT + json.dumps(counts).encode() + b"\n\n"


def _parsed(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _carries_output(event: dict[str, Any]) -> bool:
    if event.get("type") in OUTPUT_EVENTS:
        return True
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    return bool(choice.get("text") or delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


def _count(record: RequestRecord, usage: dict[str, Any]) -> None:
    """Take the figures one usage object gives (a later one, e.g. Anthropic's message_delta with only
    `output_tokens`, updates what it names)."""

    def number(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = number(details.get("cached_tokens")) if isinstance(details, dict) else None
    if "cache_read_input_tokens" in usage:  # Anthropic: the prompt is split three ways
        read, created = number(usage.get("cache_read_input_tokens")), number(usage.get("cache_creation_input_tokens"))
        rest = number(usage.get("input_tokens"))
        if rest is not None and read is not None:
            record.prompt_tokens, record.cached_tokens = rest + read + (created or 0), read
    else:
        prompt = number(usage.get("prompt_tokens", usage.get("input_tokens")))
        if prompt is not None:
            record.prompt_tokens = prompt
        if cached is not None:
            record.cached_tokens = cached
    completion = number(usage.get("completion_tokens", usage.get("output_tokens")))
    if completion is not None:
        record.completion_tokens = completion
