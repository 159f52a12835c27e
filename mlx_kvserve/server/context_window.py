"""The context window of the served model, as the APIs tell it and hold prompts to it.

A prompt past the window is refused before any work starts (after the template, before the queue and
the prefill), in each API's own words, because agents compact on those words: Anthropic's
`prompt is too long: N tokens > M maximum`, OpenAI's `context_length_exceeded` with its usual message
(chat, completions) or the Responses API's. With `[server] context_overflow = "truncate"` a chat-shaped
request drops whole older turns instead (`fit_turns`), keeping the system prompt, the tools and the
newest turns, and says how many messages went in the `x-kvserve-truncated-messages` header.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import InvalidRequestError

TRUNCATED_KEY = "kvserve.truncated_messages"  # the scope's note of messages dropped, for the header
TRUNCATED_HEADER = b"x-kvserve-truncated-messages"
RESPONSES_MESSAGE = "Your input exceeds the context window of this model. Please adjust your input and try again."
log = logging.getLogger(__name__)


class Window(NamedTuple):
    """The window a prompt is held to: `told` is what clients are told (the model's context, or
    [server] max_prompt_tokens when smaller), `max_prompt` the longest prompt accepted (one token less
    than the context, so that at least one can be generated)."""

    told: int
    max_prompt: int


def window(context: int, max_prompt_tokens: int = 0) -> Window:
    """The window of a model with `context` tokens on a server with `max_prompt_tokens` (0 = none)."""
    if max_prompt_tokens and max_prompt_tokens < context:
        return Window(max_prompt_tokens, max_prompt_tokens)
    return Window(context, max(context - 1, 0))


def window_fields(context: int, max_prompt_tokens: int, max_completion_tokens: int, anthropic: bool) -> dict[str, int]:
    """The window as a model card tells it. OpenAI's shape has no field for it: `context_length`
    (OpenRouter's, LM Studio's and Ollama's name, read by opencode and most agents), `max_model_len`
    (vLLM's) and `context_window`. Anthropic's shape: `max_input_tokens` and `max_tokens` (the most
    a request's max_tokens may ask; read by Claude Code's gateway model discovery). {} when the
    context is not known (a model never loaded)."""
    if not context:
        return {}
    told = window(context, max_prompt_tokens).told
    if anthropic:
        return {"max_input_tokens": told, "max_tokens": min(max_completion_tokens or context, context)}
    return {"context_length": told, "max_model_len": told, "context_window": told}


class ContextLengthError(InvalidRequestError):
    """A prompt longer than the window (400, code `context_length_exceeded`). The message is OpenAI's
    for chat and completions; `anthropic_message` and `responses_message` are the other APIs' words."""

    def __init__(self, num_prompt: int, win: Window, kind: str = "chat"):
        what = "messages" if kind == "chat" else "prompt"
        super().__init__(
            f"This model's maximum context length is {win.told} tokens. However, your {what} resulted in "
            f"{num_prompt} tokens. Please reduce the length of the {what}.",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
        self.num_prompt, self.window = num_prompt, win

    def anthropic_message(self) -> str:
        return f"prompt is too long: {self.num_prompt} tokens > {self.window.max_prompt} maximum"

    def responses_message(self) -> str:
        # OpenAI's words (clients match on them and on the code), then the numbers for a person reading it.
        return f"{RESPONSES_MESSAGE} ({self.num_prompt} tokens; the context window is {self.window.told} tokens)"


def check_prompt(num_prompt: int, win: Window, kind: str = "chat") -> None:
    """Raise ContextLengthError when a prompt of `num_prompt` tokens does not fit `win`."""
    if num_prompt > win.max_prompt:
        raise ContextLengthError(num_prompt, win, kind)


def cut_points(messages: list[dict[str, Any]]) -> list[int]:
    """Where the kept part of `messages` may start after older turns are dropped: at a user message
    after the leading system messages, never between a tool call and its result. In order; the
    first is where the conversation starts (nothing dropped), the last the newest user turn."""
    lead = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    called: dict[str, int] = {}  # tool call id -> index of the assistant message that made it
    spans: list[tuple[int, int]] = []  # (call, result) pairs a cut must not fall between
    for i, msg in enumerate(messages):
        for call in msg.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                called[call["id"]] = i
        if msg.get("role") == "tool" and msg.get("tool_call_id") in called:
            spans.append((called[msg["tool_call_id"]], i))
    return [
        i
        for i in range(lead, len(messages))
        if messages[i].get("role") == "user" and not any(c < i <= r for c, r in spans)
    ]


class Fitted(NamedTuple):
    """What fit_turns kept: the messages, their prompt's tokens and how many messages were dropped."""

    messages: list[dict[str, Any]]
    tokens: list[int]
    num_dropped: int


async def fit_turns(
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], Awaitable[list[int]]],
    max_prompt: int,
) -> Fitted | None:
    """The most of `messages` whose rendered prompt has at most `max_prompt` tokens: the leading system
    messages and the newest turns, whole older turns dropped (found by bisection over cut_points, one
    render each step). None when even the newest user turn alone does not fit."""
    cuts = cut_points(messages)
    if len(cuts) < 2:
        return None
    lead = messages[: next(i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer"))]

    async def kept(k: int) -> tuple[list[dict[str, Any]], list[int]]:
        msgs = lead + messages[cuts[k] :]
        return msgs, await render(msgs)

    best = await kept(len(cuts) - 1)
    if len(best[1]) > max_prompt:
        return None
    lo, hi = 1, len(cuts) - 1  # the fewest turns dropped whose prompt fits is in [lo, hi]; hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        tried = await kept(mid)
        if len(tried[1]) <= max_prompt:
            hi, best = mid, tried
        else:
            lo = mid + 1
    return Fitted(best[0], best[1], len(messages) - len(best[0]))


class TruncationHeader:
    """ASGI middleware: a response to a request whose older turns were dropped carries
    `x-kvserve-truncated-messages: K` (the handler notes K in the scope before the response starts)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_noted(message: Message) -> None:
            if message["type"] == "http.response.start" and scope.get(TRUNCATED_KEY):
                headers = [*message.get("headers", []), (TRUNCATED_HEADER, str(scope[TRUNCATED_KEY]).encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_noted)
