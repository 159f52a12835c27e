"""Anthropic `cache_control`, honoured: a marked block pins the prompt's prefix up to and including
it for the marker's TTL ("5m" by default, or "1h"), as a lease (kv/leases.py) that every later use
of that prefix refreshes and that ends by itself. A top-level marker pins the whole prompt.

Where a marked block ends in the prompt is found by rendering the request cut right after that
block through the same template: the prefix it shares with the real prompt is what gets pinned, so
a pin is always a prefix of what the request sent, whatever the template does with the cut.

A cut is a prompt, never a request: it keeps only the fields that shape the rendered prompt, and it is
rendered, not checked (a valid request's `tool_choice` may name a tool past the cut). A cut the
template refuses pins nothing; the request is served all the same.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from ..errors import KVServeError, ValidationError

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


Render = Callable[[dict[str, Any]], Awaitable[list[int]]]


async def render_cuts(handler: Any, found: list[Mark], render: Render) -> list[list[int] | None]:
    """Each mark's cut as prompt tokens, by `render(cut)` (None for a mark on the whole prompt), to
    be done before the request is submitted. A cut `render` refuses (KVServeError) is [] and pins
    nothing; nothing is rendered while the cache is off."""
    if not handler.engine.cache_enabled:
        return [[] for _ in found]
    out: list[list[int] | None] = []
    for mark in found:
        if mark.cut is None:
            out.append(None)
            continue
        try:
            out.append(await render(mark.cut))
        except KVServeError as exc:
            log.info("cache_control: the prompt cut at a marked block does not render (%s): no pin", exc.message)
            out.append([])
    return out


async def apply(
    handler: Any, found: list[Mark], cuts: list[list[int] | None], prompt: list[int], known: Sequence[bytes] = ()
) -> list[int]:
    """Lease each marked prefix of `prompt`; `cuts` from render_cuts; `known`: the prompt's block
    chain. Returns the tokens leased per mark (0 where the cache is off or the prefix holds no full
    block)."""
    if not found or not handler.engine.cache_enabled:
        return [0] * len(found)
    admin = handler.engine.cache_admin()
    leased = []
    for mark, cut in zip(found, cuts, strict=True):
        upto = len(prompt) if cut is None else shared_prefix(cut, prompt)
        leased.append(await run_in_threadpool(admin.lease, prompt[:upto], mark.ttl_s, known) if upto else 0)
    return leased
