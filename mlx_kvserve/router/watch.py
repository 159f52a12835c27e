"""Reading a backend's reply as it passes through the router, without changing a byte of it.

The router needs three things from a reply: when the first token came (the prefill is no longer pending),
how many tokens were decoded (the backend's decode load), and the usage the backend reported (its cached
prompt tokens, to set against the router's estimate). Both dialects are read: OpenAI chunks and Anthropic
message events, streamed (server-sent events) or whole (JSON). Either is read in time linear in its size
and in bounded memory, however it is cut into chunks (sse.py).
"""

from __future__ import annotations

import json
from typing import Any

from .sse import EventSplitter, fields

MAX_WHOLE_BYTES = 8 * 1024 * 1024  # a whole (non-streamed) reply is kept up to this size to read its usage
MAX_EVENT_BYTES = 1024 * 1024  # a streamed event longer than this (no token event is near it) is skipped unread


class ReplyWatcher:
    """Feed it the reply's bytes in order; it counts token events and keeps the reported usage."""

    def __init__(self, is_stream: bool):
        self.is_stream = is_stream
        self._events = EventSplitter(MAX_EVENT_BYTES)
        self._whole: list[bytes] = []
        self._whole_bytes = 0
        self.num_token_events = 0
        self.prompt_tokens: int | None = None  # as the backend reported them (None: no usage seen)
        self.cached_tokens: int | None = None

    @property
    def saw_token(self) -> bool:
        return self.num_token_events > 0

    def feed(self, chunk: bytes) -> int:
        """Take the next bytes; returns how many token events they completed."""
        if not self.is_stream:
            if self._whole_bytes + len(chunk) <= MAX_WHOLE_BYTES:
                self._whole.append(chunk)
            self._whole_bytes += len(chunk)
            return 0
        before = self.num_token_events
        for event in self._events.feed(chunk):
            if event is not None:
                self._event(event)
        return self.num_token_events - before

    def finish(self) -> None:
        """The reply is complete: read a whole reply's usage."""
        if self.is_stream or self._whole_bytes > MAX_WHOLE_BYTES:
            return
        payload = _json(b"".join(self._whole))
        if isinstance(payload, dict):
            self._usage(payload.get("usage"))

    def _event(self, raw: bytes) -> None:
        data = fields(raw)[1]
        if not data or data == b"[DONE]":
            return
        payload = _json(data)
        if not isinstance(payload, dict):
            return
        if _is_token(payload):
            self.num_token_events += 1
        if payload.get("type") != "message_start":  # its usage is a placeholder before the prefill
            self._usage(payload.get("usage"))

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens are the uncached part
            cached = _int(usage.get("cache_read_input_tokens"))
            self.cached_tokens, self.prompt_tokens = cached, cached + _int(usage.get("input_tokens"))
        elif "prompt_tokens" in usage:
            details = usage.get("prompt_tokens_details")
            self.prompt_tokens = _int(usage.get("prompt_tokens"))
            self.cached_tokens = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0


def _is_token(payload: dict[str, Any]) -> bool:
    if payload.get("type") == "content_block_delta":
        return True
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))
    return bool(choice.get("text"))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def stream_error(path_is_anthropic: bool, message: str) -> bytes:
    """The event that ends a stream cut short by its backend, in the stream's own dialect."""
    if path_is_anthropic:
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "backend_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
