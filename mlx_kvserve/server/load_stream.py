"""Keep-alives while a streamed request's model loads (several models, docs/models.md).

Loading a model can take longer than clients and proxies wait for a first byte. So a streamed request
whose model is not loaded gets its SSE headers (200, text/event-stream) at once, then the keep-alive a
long prefill sends (server/sse.py: an SSE comment, Anthropic's `ping` event on /v1/messages) every
sse.KEEP_ALIVE_S until the load is done; then the route's own stream follows without its headers. What
would have been an error status after that (the load failed, or the route refused the request) becomes
the error event that ends a stream in that API's dialect, since the status line is already sent.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.types import Message, Scope, Send

from ..errors import KVServeError
from ..registry.registry import Lease, ModelRegistry
from . import sse
from .anthropic.reply import error_body as anthropic_error_body
from .gate import note_error
from .openai import reply as oar

STREAM_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
MESSAGES_PATH, RESPONSES_PATH = "/v1/messages", "/v1/responses"


def is_stream(path: str, body: bytes) -> bool:
    """Whether the request asks for a streamed completion (`"stream": true` on a completion path)."""
    if path not in STREAM_PATHS:
        return False
    try:
        data: Any = json.loads(body) if body.strip() else None
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("stream") is True


def keep_alive(path: str) -> bytes:
    return (sse.event("ping", {}) if path == MESSAGES_PATH else sse.COMMENT_KEEP_ALIVE).encode()


def error_event(path: str, payload: dict[str, Any]) -> bytes:
    """The event that ends a stream with `payload`, the API's JSON error body for `path`."""
    if path == MESSAGES_PATH:  # {"type": "error", "error": {...}}
        return sse.event("error", {"error": payload.get("error")}).encode()
    if path == RESPONSES_PATH:  # the Responses API's `error` event
        return sse.event("error", dict(payload.get("error") or {})).encode()
    return sse.data(payload).encode()


def error_payload(path: str, exc: KVServeError) -> dict[str, Any]:
    if path == MESSAGES_PATH:
        return anthropic_error_body(exc)[0]
    return oar.error_body(exc.message, exc.error_type, exc.param, exc.code)


class StreamedLoad:
    """One streamed request waiting for its model: `acquire` sends the headers and keep-alives, then
    `send_after_headers` is the `send` the route gets."""

    def __init__(self, scope: Scope, send: Send):
        self.scope, self.path, self._send = scope, scope["path"], send
        self.client_gone = False
        self._status: int | None = None  # the status the route answered (not sent: 200 went first)
        self._held: list[bytes] = []  # the body of a route's error answer, until its end

    async def _write(self, data: bytes, more: bool = True) -> None:
        if self.client_gone:
            return
        try:
            await self._send({"type": "http.response.body", "body": data, "more_body": more})
        except OSError:  # the client left: the load goes on, its lease is released after it
            self.client_gone = True

    async def acquire(self, registry: ModelRegistry, name: str | None) -> Lease | None:
        """The model's lease once loaded, with keep-alives sent meanwhile; None when the load failed
        (its error event sent, the stream ended) or the client left (the lease released)."""
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._write(keep_alive(self.path))  # bytes at once: proxies see the stream is alive
        outcome: dict[str, Any] = {}
        done = anyio.Event()

        async def load() -> None:
            try:
                outcome["lease"] = await anyio.to_thread.run_sync(registry.acquire, name)
            except Exception as exc:
                outcome["error"] = exc
            finally:
                done.set()

        # Shielded: a client leaving during a load must not lose the lease the load returns.
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(load)
                while not done.is_set():
                    with anyio.move_on_after(sse.KEEP_ALIVE_S):
                        await done.wait()
                    if not done.is_set():
                        await self._write(keep_alive(self.path))
        error = outcome.get("error")
        if error is not None:
            exc = error if isinstance(error, KVServeError) else KVServeError(f"loading the model failed: {error}")
            note_error(self.scope, exc)
            await self._write(error_event(self.path, error_payload(self.path, exc)), more=False)
            return None
        lease: Lease = outcome["lease"]
        if self.client_gone:
            lease.release()
            return None
        return lease

    async def send_after_headers(self, message: Message) -> None:
        """The route's `send`: its status line is dropped (200 is out); an error answer's JSON body
        is held to its end and sent as the stream's error event."""
        if message["type"] == "http.response.start":
            self._status = message["status"]
            return
        if message["type"] == "http.response.body" and self._status not in (None, 200):
            self._held.append(message.get("body", b""))
            if not message.get("more_body", False):
                try:
                    payload = json.loads(b"".join(self._held))
                except ValueError:
                    payload = oar.error_body(f"the request failed ({self._status})", "server_error")
                await self._write(error_event(self.path, payload), more=False)
            return
        await self._send(message)
