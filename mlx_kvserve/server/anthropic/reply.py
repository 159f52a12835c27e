"""Anthropic Messages API replies: the message body, usage, stop reasons, errors in Anthropic's shape,
and the streamed event sequence (message_start, ping, content blocks, message_delta, message_stop)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse

from ...engine.request import Finished, TextDelta, Usage
from ...errors import KVServeError, RequestTimeoutError, ValidationError
from ...formats.output import REASONING, TOOL, Segment
from .. import sse
from ..completion import CompletionHandler, as_kvserve_error
from ..context_window import ContextLengthError
from ..openai import parse as oa

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ERROR_TYPES |= {413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def usage_body(usage: Usage, leased: int = 0) -> dict[str, int]:
    """Anthropic's split of the prompt: `cache_read_input_tokens` were served from the cache,
    `cache_creation_input_tokens` were computed now and pinned by a cache_control marker (`leased`:
    the longest prefix a marker pinned), `input_tokens` the rest. The three add up to the prompt."""
    created = max(0, min(leased, usage.prompt_tokens) - usage.cached_tokens)
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - created,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": created,
    }


def stop_reason(reason: str, num_calls: int, stop: str | None) -> str:
    if reason != "stop":
        return "max_tokens"  # "length", or cut short by shutdown
    if num_calls:
        return "tool_use"
    return "stop_sequence" if stop else "end_turn"


def matched_stop(tokenizer: Any, req: oa.CompletionRequest, text: str, ev: Finished) -> str | None:
    """Which stop sequence ended the reply, if one did. The worker reports "stop" for eos and stop
    strings alike and sends the text cut before the stop string: the generated tokens, decoded,
    hold it right after that text."""
    if ev.finish_reason != "stop" or not req.stop or not ev.token_ids:
        return None
    decoded = tokenizer.decode(list(ev.token_ids))
    rest = decoded[len(text) :] if decoded.startswith(text) else decoded
    found = [(rest.find(s), s) for s in req.stop if s in rest]
    return min(found)[1] if found else None


def _block(seg: Segment) -> list[dict[str, Any]]:
    if seg.kind == TOOL:
        return [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in seg.calls]
    if seg.kind == REASONING:
        return [{"type": "thinking", "thinking": seg.text, "signature": ""}]
    return [{"type": "text", "text": seg.text}]


def content_blocks(segments: list[Segment]) -> list[dict[str, Any]]:
    """Content blocks in the order the model wrote them; adjacent text of one kind merged."""
    blocks: list[dict[str, Any]] = []
    for seg in segments:
        for block in _block(seg):
            last = blocks[-1] if blocks else None
            key = {"text": "text", "thinking": "thinking"}.get(block["type"])
            if key and last is not None and last["type"] == block["type"]:
                last[key] += block[key]
            else:
                blocks.append(block)
    return blocks


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def message_body(
    mid: str, model: str, blocks: list, reason: str, stop: str | None, usage: Usage, leased: int = 0
) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage_body(usage, leased),
    }


def error_body(exc: KVServeError) -> tuple[dict[str, Any], int]:
    """Anthropic's error shape and status. Validation errors are 400s there, as all bad requests."""
    status = 400 if isinstance(exc, ValidationError) else exc.status_code
    kind = "invalid_request_error" if status in (400, 408, 422) else _ERROR_TYPES.get(status, "api_error")
    message = exc.anthropic_message() if isinstance(exc, ContextLengthError) else exc.message
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"type": "error", "error": {"type": kind, "message": message}}, status


def error_response(exc: KVServeError) -> JSONResponse:
    body, status = error_body(exc)
    return JSONResponse(body, status_code=status)


class BlockStream:
    """Anthropic's content-block events for a streamed reply: a block opens when the kind of text
    changes, each tool call is a block of its own."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [sse.event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse.event("content_block_stop", {"index": self.index})]

    def events(self, seg: Segment) -> list[str]:
        out: list[str] = []
        if seg.kind == TOOL:
            for call in seg.calls:
                out += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                out.append(sse.event("content_block_delta", {"index": self.index, "delta": delta}))
                out += self.close()
            return out
        kind = "thinking" if seg.kind == REASONING else "text"
        if self.open != kind:
            out += self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
        delta = {"type": f"{kind}_delta", kind: seg.text}
        return out + [sse.event("content_block_delta", {"index": self.index, "delta": delta})]


async def stream_events(
    handler: CompletionHandler, req: oa.CompletionRequest, gen_req, track, leases=None, thinking: bool = True
) -> AsyncIterator[str]:
    """message_start, ping, content blocks as the reply is written, message_delta (stop reason and
    final usage), message_stop; an `error` event ends a stream that fails after it started. A `ping`
    every sse.KEEP_ALIVE_S while the prompt prefills keeps clients and proxies from giving up on a
    long one. Without `thinking`, thinking the model writes anyway is not sent. `leases`: the request's
    cache_control leases (cache_control.PendingLeases), taken from its first event on; their count goes
    in the final usage."""
    engine, out, blocks, pieces = handler.engine, handler.output(req, gen_req), BlockStream(), []
    start = message_body(new_message_id(), engine.model_name, [], None, None, Usage(len(gen_req.prompt_tokens), 0))

    def lines(segments: list[Segment]) -> list[str]:
        return [e for seg in segments if thinking or seg.kind != REASONING for e in blocks.events(seg)]

    try:
        yield sse.event("message_start", {"message": start})
        yield sse.event("ping", {})
        while True:
            try:
                ev = await sse.next_or_keep_alive(track)
            except RequestTimeoutError as exc:
                yield sse.event("error", {"error": error_body(exc)[0]["error"]})
                return
            if ev is not sse.KEEP_ALIVE and leases is not None:
                leases.start()
            if ev is sse.KEEP_ALIVE:
                yield sse.event("ping", {})
            elif isinstance(ev, TextDelta):
                pieces.append(ev.text)
                for line in lines(out.feed(ev.text)):
                    yield line
            elif isinstance(ev, Finished):
                track.finished(ev)
                for line in lines(out.finish()) + blocks.close():
                    yield line
                stop = matched_stop(engine.tokenizer, req, "".join(pieces), ev)
                delta = {"stop_reason": stop_reason(ev.finish_reason, out.num_calls, stop), "stop_sequence": stop}
                leased = await leases.leased() if leases is not None else 0
                yield sse.event("message_delta", {"delta": delta, "usage": usage_body(ev.usage, leased)})
                yield sse.event("message_stop", {})
                return
            else:
                err = as_kvserve_error(ev.error)
                track.failed(err)
                yield sse.event("error", {"error": error_body(err)[0]["error"]})
                return
    finally:
        gen_req.cancel()
