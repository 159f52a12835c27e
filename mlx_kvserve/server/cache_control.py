"""Anthropic `cache_control`, honoured: a marked block pins the prompt's prefix up to and including
it for the marker's TTL ("5m" by default, or "1h"), as a lease (kv/leases.py) that every later use
of that prefix refreshes and that ends by itself. A top-level marker pins the whole prompt.

Where a marked block ends in the prompt is found by rendering the request cut right after that
block through the same template: the prefix it shares with the real prompt is what gets pinned, so
a pin is always a prefix of what the request sent, whatever the template does with the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from ..errors import ValidationError

TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_MARKS = 4  # Anthropic's limit on marked blocks per request
PLACEHOLDER = [{"role": "user", "content": "."}]  # stands for the messages after a cut


@dataclass(frozen=True)
class Mark:
    ttl_s: float
    cut: dict[str, Any] | None  # the request cut right after the marked block; None: the whole prompt


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


def marks(body: dict[str, Any]) -> list[Mark]:
    """Every cache_control marker of an Anthropic request (already checked by to_openai), with the
    request cut after its block. More than MAX_MARKS marked blocks is a 400, as with Anthropic."""
    out = []
    for i, tool in enumerate(_blocks(body.get("tools"))):
        if (ttl := ttl_of(tool, f"tools[{i}]")) is not None:
            out.append(Mark(ttl, {**body, "tools": body["tools"][: i + 1], "messages": PLACEHOLDER}))
    system = _blocks(body.get("system"))
    for j, block in enumerate(system):
        if (ttl := ttl_of(block, f"system[{j}]")) is not None:
            out.append(Mark(ttl, {**body, "system": system[: j + 1], "messages": PLACEHOLDER}))
    messages = _blocks(body.get("messages"))
    for k, msg in enumerate(messages):
        for j, block in enumerate(_blocks(msg.get("content") if isinstance(msg, dict) else None)):
            if isinstance(block, dict) and (ttl := ttl_of(block, f"messages[{k}].content[{j}]")) is not None:
                cut_msg = {**msg, "content": msg["content"][: j + 1]}
                out.append(Mark(ttl, {**body, "messages": messages[:k] + [cut_msg]}))
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


async def apply(handler: Any, found: list[Mark], prompt: list[int], tokens_of: Any) -> list[int]:
    """Lease each marked prefix of `prompt`. `tokens_of(cut)`: the prompt tokens of a cut request.
    Returns the tokens leased per mark (0 where the cache is off or the prefix holds no full block)."""
    if not found or handler.engine.prefix_cache.manager is None:
        return [0] * len(found)
    admin = handler.engine.cache_admin()
    leased = []
    for mark in found:
        upto = len(prompt) if mark.cut is None else shared_prefix(await tokens_of(mark.cut), prompt)
        leased.append(await run_in_threadpool(admin.lease, prompt[:upto], mark.ttl_s))
    return leased
