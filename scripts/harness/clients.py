"""Streamed chat requests to a bench server, timed from the request to the first token or delta."""

from __future__ import annotations

import json
import time
from typing import Any, NamedTuple, Protocol

import httpx

from harness import OURS, VLLM


class Server(Protocol):
    """What a client needs of a server (harness.servers.Server, which imports this module, is one)."""

    name: str
    url: str


# The servers that need the request's model named ("default"; vllm-mlx rejects a body without one);
# mlx_lm.server would load a model by that name, so it gets none.
NAMED_MODEL = {OURS, VLLM}


class ChatReply(NamedTuple):
    ttft_s: float  # seconds to the first content token
    text: str
    cached_tokens: int | None  # as reported in usage, None when not reported
    completion_tokens: int
    done_s: float = 0.0  # seconds to the last content piece (decode rate: tokens after the first over done - ttft)


def sse_chunks(server: Server, body: dict, timeout_s: float):
    """The parsed `data:` chunks of a streamed /v1/chat/completions request (an error status raises)."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=timeout_s) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def stream_chat(server: Server, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> ChatReply:
    """One streamed greedy chat completion, timed from the request to its first content token."""
    body = {
        "model": "default" if server.name in NAMED_MODEL else None,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body = {k: v for k, v in body.items() if v is not None}
    start = time.perf_counter()
    first, last, text, cached, completion = None, 0.0, [], None, 0
    for chunk in sse_chunks(server, body, timeout_s):
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                last = time.perf_counter() - start
                first = last if first is None else first
                text.append(piece)
        usage = chunk.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            completion = usage.get("completion_tokens") or 0
    ttft = first if first is not None else time.perf_counter() - start
    return ChatReply(ttft, "".join(text), cached, completion, last)


def chat_ttft(server: Server, messages: list[dict], max_tokens: int = 8) -> tuple[float, str, int | None]:
    """(seconds to the first content token, full text, cached tokens reported or None)."""
    reply = stream_chat(server, messages, max_tokens)
    return reply.ttft_s, reply.text, reply.cached_tokens


class TurnReply(NamedTuple):
    ttft_s: float  # request to the first delta with content, a tool call or reasoning
    prompt_tokens: int
    cached_tokens: int | None  # None when the server does not report them
    first: str  # what that first delta carried: "content", "tool_calls", "reasoning_content" or "none"


def stream_turn(server: Server, messages: list[dict], tools: list[dict], max_tokens: int) -> TurnReply:
    """One streamed greedy chat completion with `tools`, timed from the request to its first delta."""
    body: dict[str, Any] = {
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server.name in NAMED_MODEL:
        body["model"] = "default"
    start = time.perf_counter()
    ttft, first, usage = None, "none", {}
    for chunk in sse_chunks(server, body, 900):
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            kind = next((k for k in ("content", "tool_calls", "reasoning_content") if delta.get(k)), None)
            if kind and ttft is None:
                ttft, first = time.perf_counter() - start, kind
        usage = chunk.get("usage") or usage
    if ttft is None:  # nothing streamed before the end
        ttft = time.perf_counter() - start
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return TurnReply(ttft, usage.get("prompt_tokens", 0), cached, first)
