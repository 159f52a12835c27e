"""Server-sent events for both APIs: each payload written as strict JSON, and the streamed response that
cancels its generation however the response ends.

Strict: Python's json writes NaN and Infinity, which no JSON parser reads; here they raise instead, so a
value that should never reach the wire (a masked token's -inf logprob) fails loudly in tests rather than
breaking clients silently. Starlette's JSONResponse is strict the same way.

Keep-alive: a long prompt can prefill for minutes before the first token; clients and proxies that see
no bytes for that long give up (and often send the prompt again). While no event comes, the streams
send a keep-alive every KEEP_ALIVE_S: Anthropic's `ping` event, an SSE comment line for OpenAI's.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ..engine.request import Event, GenerationRequest
from .deadlines import EventTracker
from .gate import RECORD_KEY
from .reply_usage import USAGE_HEADER, usage_comment

KEEP_ALIVE_S = 5.0  # seconds without an event before a stream sends a keep-alive
KEEP_ALIVE = object()  # what next_or_keep_alive returns when a keep-alive is due
COMMENT_KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: every client skips it


async def next_or_keep_alive(track: EventTracker) -> Event | object | None:
    """The request's next event, or KEEP_ALIVE once KEEP_ALIVE_S passed without one (or just before a
    deadline: one keep-alive too many is harmless). Raises RequestTimeoutError as track.next does."""
    ev = await track.next(KEEP_ALIVE_S)
    return KEEP_ALIVE if ev is None else ev


def strict_json(payload: Any) -> str:
    """`payload` as JSON text; ValueError for NaN or an infinity anywhere in it."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False)


def data(payload: dict[str, Any]) -> str:
    """One `data:` event (OpenAI's streams)."""
    return f"data: {strict_json(payload)}\n\n"


def event(kind: str, payload: dict[str, Any]) -> str:
    """One named event whose data is `{"type": kind, **payload}` (Anthropic's streams)."""
    return f"event: {kind}\ndata: {strict_json({'type': kind, **payload})}\n\n"


class GenerationStream(StreamingResponse):
    """An event stream that cancels its generations (one per choice) when the response ends, however
    it ends. The events' own generator cancels too, but only once it has started: a client gone
    before the first event (or a failed send) would otherwise leave them running for nobody."""

    def __init__(self, events: Any, *gen_reqs: GenerationRequest):
        super().__init__(events, media_type="text/event-stream")
        self.gen_reqs = gen_reqs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = scope.get(RECORD_KEY)
        if record is not None and any(name == USAGE_HEADER for name, _ in scope["headers"]):
            send = _usage_last(send, record)  # our server relaying a model's own process asks for it
        try:
            await super().__call__(scope, receive, send)
        finally:
            for gen_req in self.gen_reqs:
                gen_req.cancel()  # a no-op once the generation has finished


def _usage_last(send: Send, record: Any) -> Send:
    """`send`, with the request's closing usage comment (server/reply_usage.py) before the end."""

    async def send_usage_last(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await send({"type": "http.response.body", "body": usage_comment(record), "more_body": True})
        await send(message)

    return send_usage_last
