"""OpenAI response shapes: whole replies, streamed chunks, usage and errors. Pure functions."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from ...engine.request import Usage
from ...formats import tool_calls as tl

if TYPE_CHECKING:
    from .parse import CompletionRequest


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def public_finish_reason(reason: str) -> str:
    # A request cut short by shutdown ends like one that ran out of tokens.
    return "length" if reason == "cancelled" else reason


def response_body(
    req: CompletionRequest,
    rid: str,
    model: str,
    text: str,
    reason: str,
    usage: Usage,
    reasoning: str = "",
    tool_calls: tuple[tl.ToolCall, ...] | list[tl.ToolCall] = (),
    logprobs: dict[str, Any] | None = None,
) -> dict:
    """The whole reply. A chat reply with tool calls ends with "tool_calls" (unless cut by
    max_tokens) and has null content when the model wrote nothing else."""
    reason = public_finish_reason(reason)
    if req.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = [call.openai() for call in tool_calls]
            reason = "tool_calls" if reason == "stop" else reason
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_body(usage),
    }


def chunk_body(
    req: CompletionRequest,
    rid: str,
    model: str,
    text: str | None,
    reason: str | None,
    first: bool = False,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict:
    """One streamed chunk: text (None for none), reasoning text, tool-call deltas (each with its
    `index`) and, on the last content chunk, the finish reason."""
    reason = public_finish_reason(reason) if reason else None
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(req: CompletionRequest, rid: str, model: str, usage: Usage) -> dict:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
