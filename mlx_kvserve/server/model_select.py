"""Which model serves a request, when the server has several ([[models]]): an ASGI middleware inside the
gate (so the body is already read and bounded) that resolves the request's `model`, leases that model
(loading it first when needed: the request waits; concurrent ones share the load) and binds the
request to its engine (registry/front.py) until the response's last byte. An unknown id is a 404
naming the registered ones, in the API's own error shape.

Selected: completions and embeddings (gate.LIMITED_PATHS: the body's "model") and the cache admin routes
(the `model` query parameter or body field; the default model without one). /v1/cache/models is the
registry's own. A chat model named on /v1/embeddings, or an embedding model anywhere else, is a 400 before
anything loads.

A streamed request whose model is not loaded gets its SSE headers at once and keep-alives while the model
loads (load_stream.py), as a long prefill does. A model in a process of its own (`process = true`) is
leased the same way; its requests then pass through to that process (model_proxy.py).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import InvalidRequestError, KVServeError
from ..registry.front import bind, unbind
from ..registry.registry import LOADED, ModelRegistry, ModelSlot
from .anthropic.reply import error_response as anthropic_error
from .embeddings import EMBEDDINGS_PATH, not_an_embedding_model
from .gate import ADMIN_PREFIX, BODY_METHODS, LIMITED_PATHS, error_response, note_error, replay
from .keep_alive import requested_keep_alive
from .load_stream import StreamedLoad, is_stream
from .model_process import ModelProcess
from .model_proxy import forward
from .response_lookup import is_lookup, lookup
from .ui_routes import REQUESTS_PATH

MODELS_ADMIN_PREFIX = ADMIN_PREFIX + "/models"


def _is_selected(scope: Scope) -> bool:
    path = scope["path"]
    if path == MODELS_ADMIN_PREFIX or path.startswith(MODELS_ADMIN_PREFIX + "/") or path == REQUESTS_PATH:
        return False  # the registry's own; the requests log is this process's (it sees every model's requests)
    return (path in LIMITED_PATHS and scope["method"] == "POST") or path.startswith(ADMIN_PREFIX + "/")


def requested_model(scope: Scope, body: bytes) -> str | None:
    """The `model` a request names: its JSON body's field, else the query's; None when neither holds a
    string (the default model then serves it, and its own parser reports a malformed body)."""
    try:
        data: Any = json.loads(body) if body.strip() else None
    except ValueError:  # the route reports it
        data = None
    if isinstance(data, dict) and isinstance(data.get("model"), str):
        return data["model"]
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model")
    return values[0] if values else None


def check_kind(slot: ModelSlot, path: str) -> None:
    """InvalidRequestError (400) when the model cannot serve `path`: embeddings need an embedding
    model, and an embedding model serves nothing else (it has no chat template and no KV cache)."""
    name = slot.entry.name
    if path == EMBEDDINGS_PATH:
        if slot.entry.kind != "embedding":
            raise not_an_embedding_model(name)
    elif slot.entry.kind == "embedding":
        raise InvalidRequestError(
            f"model {name!r} is an embedding model: it serves /v1/embeddings only", param="model", code="model_not_chat"
        )


class ModelSelect:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp, registry: ModelRegistry):
        self.app, self.registry = app, registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_lookup(scope):  # a stored response may live in a model's own process
            await lookup(self.app, self.registry, scope, receive, send)
            return
        if scope["type"] != "http" or not _is_selected(scope):
            await self.app(scope, receive, send)
            return
        body = b""
        if scope["method"] in BODY_METHODS:  # the gate replays the whole body as one message
            body = (await receive()).get("body", b"")
            receive = replay(body, receive)
        name = requested_model(scope, body)
        try:
            keep_alive = requested_keep_alive(body)  # 422 before anything loads
            slot = self.registry.resolve(name)  # 404 before anything loads
            check_kind(slot, scope["path"])
            if is_stream(scope["path"], body) and slot.state != LOADED:
                load = StreamedLoad(scope, send)
                lease = await load.acquire(self.registry, name)
                if lease is None:  # failed (its error event sent) or the client left
                    return
                send = load.send_after_headers
            else:
                # Shielded: a client leaving during a load must not lose the lease the load returns.
                with anyio.CancelScope(shield=True):
                    lease = await anyio.to_thread.run_sync(self.registry.acquire, name)
        except KVServeError as exc:
            note_error(scope, exc)
            reply = anthropic_error if scope["path"].startswith("/v1/messages") else error_response
            await reply(exc)(scope, receive, send)
            return
        if keep_alive is not None:
            self.registry.set_keep_alive(lease.slot, keep_alive)
        if isinstance(lease.engine, ModelProcess):  # a model in a process of its own serves it there
            try:
                await forward(lease.engine, scope, receive, send)
            finally:
                lease.release()
            return
        token = bind(lease, name)
        try:
            await self.app(scope, receive, send)
        finally:
            unbind(token)
            lease.release()
