"""What a cache-aware router needs from this server: the block layout and the block events.

GET /v1/cache/layout: the hashing namespace and block size (the router hashes prompts the same way), the
model it serves, and the event log's epoch and newest sequence number.

GET /v1/cache/events?since=N&epoch=E: server-sent events. `snapshot` (every hash in RAM, with the sequence
number it is current from) comes first when the follower names no position, another epoch (a restarted
server) or a position the bounded log has dropped; then `events` messages carry the stored / removed hashes in
the order RAM changed. The stream ends after `max_s` seconds (the follower reconnects with its position and
misses nothing), so an open stream never holds up a server's graceful shutdown for long. `stream=false`
answers the same messages once as JSON, for polling followers and scripts.

Both sit under /v1/cache/, so they need the admin key where one is set: block hashes tell which prompts are
cached here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.cache.router_view import RouterView
from ..engine.front import EngineFront
from ..errors import NotFoundError, ValidationError

POLL_S = 0.02  # how often an open stream looks for new events: the router's view lags RAM by about this
HEARTBEAT_S = 2.0  # a comment line this often keeps proxies from closing an idle stream
DEFAULT_STREAM_S = 5.0
MAX_STREAM_S = 60.0


def _int_param(request: Request, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19) or not low <= int(raw) <= high:
        raise ValidationError(f"'{name}' must be an integer in [{low}, {high}], got {raw!r}", param=name)
    return int(raw)


def _float_param(request: Request, name: str, default: float, low: float, high: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # NaN fails too
        raise ValidationError(f"'{name}' must be a number in [{low:g}, {high:g}], got {raw!r}", param=name)
    return value


def _sse(message: dict[str, Any]) -> str:
    return f"event: {message['type']}\ndata: {json.dumps(message)}\n\n"


async def _stream(view: RouterView, since: int | None, epoch: str | None, max_s: float) -> AsyncIterator[str]:
    ends = time.monotonic() + max_s
    quiet_since = time.monotonic()
    epoch = epoch or None
    while time.monotonic() < ends:
        messages, since = view.next_messages(since, epoch)
        epoch = view.epoch
        for message in messages:
            yield _sse(message)
        if messages:
            quiet_since = time.monotonic()
            continue  # a full page: there may be more right away
        if time.monotonic() - quiet_since >= HEARTBEAT_S:
            yield ": ping\n\n"
            quiet_since = time.monotonic()
        await asyncio.sleep(POLL_S)
    yield "event: end\ndata: {}\n\n"


def router_routes(engine: EngineFront) -> list[Route]:
    def view_or_404() -> RouterView:
        view = engine.router_view()
        if view is None:
            raise NotFoundError(f"the block cache is off on this server: {engine.cache_reason}", code="cache_disabled")
        return view

    async def layout(request: Request) -> Response:
        body: dict[str, Any] = {"model": engine.model_name, "model_path": str(engine.model_path)}
        view = engine.router_view()
        if view is None:
            return JSONResponse({**body, "enabled": False, "reason": engine.cache_reason})
        return JSONResponse({**body, "enabled": True, **view.layout()})

    async def events(request: Request) -> Response:
        view = view_or_404()
        since = _int_param(request, "since", None, 0, 2**62)
        epoch = request.query_params.get("epoch")
        max_s = _float_param(request, "max_s", DEFAULT_STREAM_S, 0.0, MAX_STREAM_S)
        stream = request.query_params.get("stream", "true")
        if stream not in ("true", "false"):
            raise ValidationError("'stream' must be true or false", param="stream")
        if stream == "false":
            messages, _ = view.next_messages(since, epoch)
            return JSONResponse({"epoch": view.epoch, "messages": messages})
        return StreamingResponse(
            _stream(view, since, epoch, max_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    return [
        Route("/v1/cache/layout", layout, methods=["GET"]),
        Route("/v1/cache/events", events, methods=["GET"]),
    ]
