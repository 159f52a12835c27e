"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): request and
response shapes only. A request is translated into an OpenAI chat request and served by the same
CompletionHandler path (same template, same engine, same block cache), so a long system prompt with
tools hits the cache from either API.

`cache_control` blocks are accepted and treated as a normal prefix: the block cache keeps every
prompt's blocks anyway, so the marked prefix is cached like the rest; no pin is taken (pins have no
TTL yet, and a pin per request would never expire).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.request import Finished, TextDelta, Usage
from ..errors import InvalidRequestError, KVServeError, RequestTimeoutError, ValidationError
from . import openai as oa
from . import tools as tl
from .output import REASONING, TOOL, Segment

if TYPE_CHECKING:
    from .app import CompletionHandler

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p"}
FIELDS |= {"metadata", "tools", "tool_choice", "cache_control", "thinking"}  # metadata only names the caller
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ERROR_TYPES |= {413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


# --- request ------------------------------------------------------------------------------------------


def _check_cache_control(block: dict[str, Any], where: str) -> None:
    marker = block.get("cache_control")
    if marker is not None and (not isinstance(marker, dict) or marker.get("type") != "ephemeral"):
        raise ValidationError(f'{where}.cache_control must be {{"type": "ephemeral"}}', param=where)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ValidationError(f"{where} must be a string or an array of content blocks", param=where)
    for j, block in enumerate(content):
        _check_cache_control(block, f"{where}[{j}]")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ValidationError(f"{where}.text must be a string", param=where)
    return block["text"]


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    parts = _blocks(content, f"{where}.content")
    if any(p.get("type") != "text" for p in parts):
        raise InvalidRequestError(f"{where}.content may hold text blocks only", param=where)
    text = "".join(_text(p, where) for p in parts)
    return f"Error: {text}" if block.get("is_error") else text


def _message(msg: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: tool_result blocks become `tool` messages, in order."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise ValidationError(f"{where} must be an object with role 'user' or 'assistant'", param="messages")
    role, out, text, calls, thinking = msg["role"], [], [], [], []
    for j, block in enumerate(_blocks(msg.get("content"), f"{where}.content")):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            text.append(_text(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ValidationError(f"{at} needs a string 'id' and 'name'", param="messages")
            args = block.get("input", {})
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}}
            )
        elif kind == "tool_result" and role == "user":
            if text:  # keep the order of text and results
                out.append({"role": "user", "content": "".join(text)})
                text = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ValidationError(f"{at}.tool_use_id must be a string", param="messages")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _result_text(block, at)})
        elif kind == "thinking" and role == "assistant":
            thinking.append(block.get("thinking", ""))
        else:
            raise InvalidRequestError(f"{at}: content block type {kind!r} is not supported here", param="messages")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        return [message]
    return out + ([{"role": "user", "content": "".join(text)}] if text or not out else [])


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    blocks = _blocks(raw, "system")
    if any(b.get("type") != "text" for b in blocks):
        raise ValidationError("'system' may hold text blocks only", param="system")
    return [{"role": "system", "content": "".join(_text(b, "system") for b in blocks)}]


def _tools(body: dict[str, Any], out: dict[str, Any]) -> None:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None:
        if not isinstance(raw, list):
            raise ValidationError("'tools' must be an array", param="tools")
        functions = []
        for i, tool in enumerate(raw):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise InvalidRequestError(
                    f"tools[{i}]: only client tools (name, input_schema) are supported", param="tools"
                )
            _check_cache_control(tool, f"tools[{i}]")
            fn = {"name": tool.get("name"), "parameters": tool.get("input_schema", {})}
            if "description" in tool:
                fn["description"] = tool["description"]
            functions.append({"type": "function", "function": tl.check_function(fn, f"tools[{i}]", "tools")})
        out["tools"] = functions
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "none", "any", "tool"):
            raise ValidationError("'tool_choice' must be {type: auto | none | any | tool}", param="tool_choice")
        if choice["type"] in ("any", "tool"):
            raise InvalidRequestError(f"'tool_choice' {choice['type']!r} {tl.NEEDS_CONSTRAINED}", param="tool_choice")
        out["tool_choice"] = choice["type"]
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False


def to_openai(body: Any, count_only: bool = False) -> dict[str, Any]:
    """The OpenAI chat body that serves an Anthropic Messages body. Fields not served are a 400
    naming them; `max_tokens` is required (not for count_tokens)."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
    if body.get("max_tokens") is None and not count_only:
        raise ValidationError("'max_tokens' is required", param="max_tokens")
    if not isinstance(body.get("metadata", {}), dict):
        raise ValidationError("'metadata' must be an object", param="metadata")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ValidationError("'messages' must be a non-empty array", param="messages")
    messages = _system(body.get("system")) + [m for i, msg in enumerate(raw) for m in _message(msg, i)]
    out: dict[str, Any] = {"messages": messages, "max_tokens": None if count_only else body["max_tokens"]}
    for ours, theirs in (("model", "model"), ("stream", "stream"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    _check_cache_control(body, "request")  # automatic caching: every prefix is cached anyway
    _tools(body, out)
    _thinking(body.get("thinking"), out)
    return out


def _thinking(raw: Any, out: dict[str, Any]) -> None:
    """`thinking` turns the template's enable_thinking on or off. `budget_tokens` is checked, not
    enforced apart: max_tokens bounds thinking and text together."""
    if raw is None:
        return
    if not isinstance(raw, dict) or raw.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValidationError("'thinking' must be {type: enabled | disabled | adaptive}", param="thinking")
    budget = raw.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValidationError("'thinking.budget_tokens' must be a positive integer", param="thinking")
    out["chat_template_kwargs"] = {"enable_thinking": raw["type"] != "disabled"}


# --- response -----------------------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, int]:
    """Anthropic's split: `input_tokens` are the prompt tokens computed now, `cache_read_input_tokens`
    those served from the cache (their sum is the prompt). Every computed block is cached as well,
    with no marker asked for, so no tokens are reported as `cache_creation_input_tokens`."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
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


def message_body(mid: str, model: str, blocks: list, reason: str, stop: str | None, usage: Usage) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage_body(usage),
    }


def error_body(exc: KVServeError) -> tuple[dict[str, Any], int]:
    """Anthropic's error shape and status. Validation errors are 400s there, as all bad requests."""
    status = 400 if isinstance(exc, ValidationError) else exc.status_code
    kind = "invalid_request_error" if status in (400, 408, 422) else _ERROR_TYPES.get(status, "api_error")
    message = exc.message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"type": "error", "error": {"type": kind, "message": message}}, status


def error_response(exc: KVServeError) -> JSONResponse:
    body, status = error_body(exc)
    return JSONResponse(body, status_code=status)


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


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
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def events(self, seg: Segment) -> list[str]:
        out: list[str] = []
        if seg.kind == TOOL:
            for call in seg.calls:
                out += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
                out += self.close()
            return out
        kind = "thinking" if seg.kind == REASONING else "text"
        if self.open != kind:
            out += self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
        delta = {"type": f"{kind}_delta", kind: seg.text}
        return out + [_event("content_block_delta", {"index": self.index, "delta": delta})]


# --- routes -------------------------------------------------------------------------------------------


def _kvserve_error(exc: Exception) -> KVServeError:
    return exc if isinstance(exc, KVServeError) else KVServeError(f"generation failed: {type(exc).__name__}: {exc}")


def anthropic_routes(handler: CompletionHandler, read_json: Callable) -> list[Route]:
    """/v1/messages and /v1/messages/count_tokens, served by `handler` (the OpenAI chat path)."""
    engine = handler.engine

    async def parse(request: Request, count_only: bool = False) -> oa.CompletionRequest:
        body = await read_json(request, engine.config.server.max_body_bytes)
        return oa.parse_request(to_openai(body, count_only), "chat", handler.defaults)

    async def messages(request: Request) -> Response:
        try:
            req = await parse(request)
            gen_req, track = await handler.submit(request, req)
            if req.stream:
                return StreamingResponse(_stream(handler, req, gen_req, track), media_type="text/event-stream")
            done = await handler.collect(request, gen_req, track)
        except KVServeError as exc:
            return error_response(exc)
        if isinstance(done, Response):  # the client left
            return done
        text, ev = done
        out = handler.output(req, gen_req)
        segments = out.feed(text) + out.finish()
        stop = matched_stop(engine.loaded.tokenizer, req, text, ev)
        reason = stop_reason(ev.finish_reason, out.num_calls, stop)
        body = message_body(new_message_id(), engine.model_name, content_blocks(segments), reason, stop, ev.usage)
        return JSONResponse(body)

    async def count_tokens(request: Request) -> Response:
        try:
            req = await parse(request, count_only=True)
            handler.check_model(req.model)
            return JSONResponse({"input_tokens": len(await handler.tokens(req))})
        except KVServeError as exc:
            return error_response(exc)

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


async def _stream(handler: CompletionHandler, req: oa.CompletionRequest, gen_req, track) -> AsyncIterator[str]:
    """message_start, ping, content blocks as the reply is written, message_delta (stop reason and
    final usage), message_stop; an `error` event ends a stream that fails after it started."""
    engine, out, blocks, pieces = handler.engine, handler.output(req, gen_req), BlockStream(), []
    start = message_body(new_message_id(), engine.model_name, [], None, None, Usage(len(gen_req.prompt_tokens), 0))
    try:
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        while True:
            try:
                ev = await track.next()
            except RequestTimeoutError as exc:
                yield _event("error", {"error": error_body(exc)[0]["error"]})
                return
            if ev is None:
                continue
            if isinstance(ev, TextDelta):
                pieces.append(ev.text)
                for seg in out.feed(ev.text):
                    for line in blocks.events(seg):
                        yield line
            elif isinstance(ev, Finished):
                track.finished(ev)
                for line in [e for seg in out.finish() for e in blocks.events(seg)] + blocks.close():
                    yield line
                stop = matched_stop(engine.loaded.tokenizer, req, "".join(pieces), ev)
                delta = {"stop_reason": stop_reason(ev.finish_reason, out.num_calls, stop), "stop_sequence": stop}
                yield _event("message_delta", {"delta": delta, "usage": usage_body(ev.usage)})
                yield _event("message_stop", {})
                return
            else:
                err = _kvserve_error(ev.error)
                track.failed(err)
                yield _event("error", {"error": error_body(err)[0]["error"]})
                return
    finally:
        gen_req.cancel()
