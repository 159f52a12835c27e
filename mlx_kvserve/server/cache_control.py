"""Anthropic `cache_control`, honoured: a marked block pins the prompt's prefix up to and including
it for the marker's TTL ("5m" by default, or "1h"), as a lease (kv/leases.py) that every later use
of that prefix refreshes and that ends by itself. A top-level marker pins the whole prompt.

Where a marked block ends in the prompt is found by rendering the request cut right after that
block through the same template: the prefix it shares with the real prompt is what gets pinned, so
a pin is always a prefix of what the request sent, whatever the template does with the cut. Where the
token memo encoded the prompt, the cut is compared as text, and the prompt's tokens wholly inside the
shared characters are the prefix: nothing is encoded for it (a cut such as Claude Code's first system
block, followed by its tool list, shares no special token with the prompt past the template's opening,
so encoding it would cost as much as the prompt). Without a memo, the cut's ids are compared.

A cut is a prompt, never a request: it keeps only the fields that shape the rendered prompt, and it is
rendered, not checked (a valid request's `tool_choice` may name a tool past the cut). A cut the
template refuses pins nothing; the request is served all the same.

Nothing waits on a lease but the reply's final usage (`cache_creation_input_tokens`), so a request's
leases are taken beside its reply (PendingLeases): a stream's once its first event is out. Only a model
that keeps states where the marked prefixes end (hybrid, sliding window) finds them before the prompt
is submitted: its checkpoints go there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from starlette.concurrency import run_in_threadpool

from ..engine.cache.token_memo import common_prefix
from ..errors import KVServeError, ValidationError
from .gate import PRINCIPAL

log = logging.getLogger(__name__)

TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_MARKS = 4  # Anthropic's limit on marked blocks per request
PLACEHOLDER = [{"role": "user", "content": "."}]  # stands for the messages after a cut
# What a cut keeps: the fields the template renders (output_config: its effort is a template variable).
PROMPT_FIELDS = ("system", "tools", "messages", "thinking", "output_config")


@dataclass(frozen=True)
class Mark:
    ttl_s: float
    cut: dict[str, Any] | None  # the prompt cut right after the marked block (PROMPT_FIELDS); None: the whole prompt


def ttl_of(block: dict[str, Any], where: str) -> float | None:
    """The TTL of a block's `cache_control` (None when it has none); 400 for a bad marker."""
    marker = block.get("cache_control")
    if marker is None:
        return None
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
        raise ValidationError(f'{where}.cache_control must be {{"type": "ephemeral"}}', param=where)
    ttl = marker.get("ttl", "5m")
    if ttl not in TTL_S:
        raise ValidationError(f"{where}.cache_control.ttl must be '5m' or '1h'", param=where)
    return TTL_S[ttl]


def _blocks(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _cut(body: dict[str, Any], **parts: Any) -> dict[str, Any]:
    """The prompt fields of `body` with `parts` cut short: what the template renders, nothing to check."""
    return {name: body[name] for name in PROMPT_FIELDS if name in body} | parts


def marks(body: dict[str, Any]) -> list[Mark]:
    """Every cache_control marker of an Anthropic request (already checked by to_openai), with the
    prompt cut after its block. More than MAX_MARKS marked blocks is a 400, as with Anthropic."""
    out = []
    for i, tool in enumerate(_blocks(body.get("tools"))):
        if (ttl := ttl_of(tool, f"tools[{i}]")) is not None:
            out.append(Mark(ttl, _cut(body, tools=body["tools"][: i + 1], messages=PLACEHOLDER)))
    system = _blocks(body.get("system"))
    for j, block in enumerate(system):
        if (ttl := ttl_of(block, f"system[{j}]")) is not None:
            out.append(Mark(ttl, _cut(body, system=system[: j + 1], messages=PLACEHOLDER)))
    messages = _blocks(body.get("messages"))
    for k, msg in enumerate(messages):
        for j, block in enumerate(_blocks(msg.get("content") if isinstance(msg, dict) else None)):
            if isinstance(block, dict) and (ttl := ttl_of(block, f"messages[{k}].content[{j}]")) is not None:
                cut_msg = {**msg, "content": msg["content"][: j + 1]}
                out.append(Mark(ttl, _cut(body, messages=messages[:k] + [cut_msg])))
    if len(out) > MAX_MARKS:
        raise ValidationError(f"at most {MAX_MARKS} blocks may have cache_control, got {len(out)}")
    if (ttl := ttl_of(body, "request")) is not None:  # automatic caching: the whole prompt
        out.append(Mark(ttl, None))
    return out


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Cut(NamedTuple):
    """How the route renders a cut: `text(cut)`, the template's text (None without a token memo), and
    `tokens(cut)`, its ids; either raises KVServeError for a cut the template refuses."""

    text: Callable[[dict[str, Any]], Awaitable[str | None]]
    tokens: Callable[[dict[str, Any]], Awaitable[list[int]]]


async def marked_ends(
    handler: Any, found: list[Mark], prompt: list[int], prompt_text: str | None, render: Cut
) -> list[int]:
    """Per mark, how many of `prompt`'s tokens its marked prefix holds (all of them for a mark on the
    whole prompt; 0 for a cut the template refuses, or while the cache is off). Where the token memo
    encoded the prompt (`prompt_text`: its text): the prompt's tokens wholly within the characters the
    cut's text shares with it, with nothing encoded; else the tokens the cut's own ids share with it."""
    if not handler.engine.cache_enabled:
        return [0] * len(found)
    out = []
    for mark in found:
        try:
            out.append(len(prompt) if mark.cut is None else await _end(handler, mark.cut, prompt, prompt_text, render))
        except KVServeError as exc:
            log.info("cache_control: the prompt cut at a marked block does not render (%s): no pin", exc.message)
            out.append(0)
    return out


async def _end(handler: Any, cut: dict[str, Any], prompt: list[int], prompt_text: str | None, render: Cut) -> int:
    text = await render.text(cut) if prompt_text is not None else None
    if prompt_text is not None and text is not None:
        chars = common_prefix(text, prompt_text)
        within = await run_in_threadpool(handler.engine.tokens_within, prompt_text, prompt, chars, PRINCIPAL.get())
        if within is not None:
            return within
    return shared_prefix(await render.tokens(cut), prompt)


async def apply(
    handler: Any, found: list[Mark], ends: list[int], prompt: list[int], known: Sequence[bytes] = ()
) -> list[int]:
    """Lease each marked prefix of `prompt`; `ends` from marked_ends; `known`: the prompt's block
    chain. Returns the tokens leased per mark (0 where the cache is off or the prefix holds no full
    block)."""
    if not found or not handler.engine.cache_enabled:
        return [0] * len(found)
    admin = handler.engine.cache_admin()
    leased = []
    for mark, upto in zip(found, ends, strict=True):
        leased.append(await run_in_threadpool(admin.lease, prompt[:upto], mark.ttl_s, known) if upto else 0)
    return leased


class PendingLeases:
    """A request's leases, taken once `start` is called (or when their count is asked): the tokens
    leased, for the final usage. A lease that fails is logged and counts 0 (the reply is out by then)."""

    def __init__(self, take: Callable[[], Awaitable[int]]):
        self._take = take
        self._task: asyncio.Task[int] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._taken())

    async def leased(self) -> int:
        self.start()
        assert self._task is not None
        return await asyncio.shield(self._task)  # a client leaving does not stop a lease half-taken

    async def _taken(self) -> int:
        try:
            return await self._take()
        except Exception as exc:  # a marker is a hint about the cache: the reply stands without its pin
            log.warning("cache_control: the marked prefixes could not be leased (%s)", exc)
            return 0
