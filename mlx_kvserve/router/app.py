"""The router's Starlette app: the servers' inference endpoints proxied, /health, /metrics, an API key.

Each backend gets a BackendFollower (health polls, block events) for the app's life. The tokenizer that
turns prompts into the backends' block hashes is loaded from `router.tokenizer`, or else from the model the
first backend reports; until it is there (or when it cannot be loaded) requests are routed without a cache
estimate, by load and session alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import RouterConfig
from ..errors import AuthenticationError, ConfigError, KVServeError, PayloadTooLargeError
from ..server.anthropic.reply import error_response as anthropic_error
from ..server.gate import error_response as openai_error
from ..server.local_guard import LocalGuard, guard_policy
from ..server.ui_routes import mount_router_ui
from .backends import BackendState
from .follower import BackendFollower
from .prompts import (
    CHAT_PATH,
    MESSAGES_PATH,
    RESPONSES_PATH,
    TEXT_PATH,
    PromptInfo,
    PromptReader,
    load_tokenizer,
    model_of,
)
from .proxy import CLIENT_CLOSED, Router, UpstreamTimeouts

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health"})


def read_key(value: str, path: str, name: str) -> str:
    """The key set inline or in a file (whitespace stripped). ConfigError naming `router.<name>_file`."""
    if not path:
        return value
    try:
        key = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"router.{name}_file: cannot read {path}: {exc}", param=f"router.{name}_file") from None
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ConfigError(f"router.{name}_file: {path} holds no usable key", param=f"router.{name}_file")
    return key


def _error(path: str, exc: KVServeError) -> Response:
    return anthropic_error(exc) if path.startswith(MESSAGES_PATH) else openai_error(exc)


class KeyCheck:
    """ASGI middleware: every path but /health needs the router's key (Bearer or x-api-key) when one is set."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            token = token.strip() if scheme.lower() == b"bearer" else headers.get(b"x-api-key", b"").strip()
            if not hmac.compare_digest(token, self.key):
                err = AuthenticationError(
                    "the router needs its API key as 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await _error(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the router's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class TokenizerSlot:
    """The router's tokenizer, loaded once in a thread: from the configured spec, or from the first
    backend's model (its folder when this machine has it, else its name as a hub id)."""

    def __init__(self, reader: PromptReader, spec: str, loader: Callable[[str], Any]):
        self.reader, self.spec, self.loader = reader, spec, loader
        self.task: asyncio.Task | None = None
        self.error = ""

    def start(self, spec: str) -> None:
        if self.task is None and self.reader.tokenizer is None and spec:
            self.task = asyncio.get_running_loop().create_task(self._load(spec))

    def from_backend(self, model: str, model_path: str) -> None:
        if not self.spec:
            self.start(model_path if model_path and Path(model_path).is_dir() else model)

    async def _load(self, spec: str) -> None:
        try:
            self.reader.tokenizer = await run_in_threadpool(self.loader, spec)
            log.info("router tokenizer: %s", spec)
        except Exception as exc:  # hub errors, missing files: routing goes on without cache estimates
            self.error = f"cannot load the tokenizer {spec!r}: {type(exc).__name__}: {exc}"
            log.error("%s; routing without cache estimates", self.error)


def create_router_app(
    config: RouterConfig,
    tokenizer: Any | None = None,
    tokenizer_loader: Callable[[str], Any] = load_tokenizer,
    client_key: str | None = None,
    backend_key: str | None = None,
) -> Starlette:
    """The router app over `config.backends`. Keys default to the config's (files read now: ConfigError)."""
    client_key = read_key(config.api_key, config.api_key_file, "api_key") if client_key is None else client_key
    if backend_key is None:
        backend_key = read_key(config.backend_api_key, config.backend_api_key_file, "backend_api_key")
    backend_headers = {"authorization": f"Bearer {backend_key}"} if backend_key else {}
    backends = [BackendState(url.rstrip("/")) for url in config.backends]
    reader = PromptReader(tokenizer)
    slot = TokenizerSlot(reader, config.tokenizer, tokenizer_loader)
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=None, write=None, pool=None)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    timeouts = UpstreamTimeouts(config.connect_timeout_s, config.first_byte_timeout_s, config.read_timeout_s)
    router = Router(backends, client, config.policy, config.overload_factor, backend_headers, timeouts=timeouts)
    followers = [
        BackendFollower(
            b,
            client,
            backend_headers,
            config.health_interval_s,
            on_layout=slot.from_backend,
            on_resync=lambda url=b.url: router.metrics.resyncs.labels(url).inc(),
            connect_timeout_s=config.connect_timeout_s,
        )
        for b in backends
    ]

    async def generate(request: Request) -> Response:
        path = request.url.path
        try:
            body = await read_body(request, config.max_body_bytes)
            try:
                parsed = json.loads(body)
            except (ValueError, RecursionError):
                parsed = None  # the backend answers it
            info = await run_in_threadpool(reader.read, path, parsed, request.headers, config.session_header)
            # A follow-up to a stored response is served only where that response is stored (404 elsewhere).
            searches = path == RESPONSES_PATH and isinstance(parsed, dict) and bool(parsed.get("previous_response_id"))
            return await router.forward(request, body, info, searches=searches)
        except KVServeError as exc:
            return _error(path, exc)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)

    async def passthrough(request: Request, searches: bool = False) -> Response:
        try:
            body = await read_body(request, config.max_body_bytes)
            try:
                model = model_of(json.loads(body)) if body else None
            except (ValueError, RecursionError):
                model = None  # the backend answers it
            info = PromptInfo(None, None, False, model)
            return await router.forward(request, body, info, generates=False, searches=searches)
        except KVServeError as exc:
            return _error(request.url.path, exc)

    async def stored(request: Request) -> Response:
        """GET / DELETE of a stored response: only the backend that served it holds it."""
        return await passthrough(request, searches=True)

    async def health(request: Request) -> Response:
        body = health_report(router, followers, config.policy, slot)
        return JSONResponse(body, status_code=200 if body["status"] != "down" else 503)

    async def metrics(request: Request) -> Response:
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        slot.start(config.tokenizer)
        tasks = [asyncio.create_task(f.run_health()) for f in followers]
        tasks += [asyncio.create_task(f.run_events()) for f in followers]
        log.info("routing over %d backends with policy %s", len(backends), config.policy)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.aclose()

    routes = [
        Route(CHAT_PATH, generate, methods=["POST"]),
        Route(TEXT_PATH, generate, methods=["POST"]),
        Route(MESSAGES_PATH, generate, methods=["POST"]),
        Route(MESSAGES_PATH + "/count_tokens", passthrough, methods=["POST"]),
        Route(RESPONSES_PATH, generate, methods=["POST"]),  # Codex CLI and the OpenAI Agents SDK speak only this
        Route(RESPONSES_PATH + "/{response_id}", stored, methods=["GET", "DELETE"]),
        Route("/v1/embeddings", generate, methods=["POST"]),  # by model, then load (no prompt to hash)
        Route("/v1/models", passthrough, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.router.redirect_slashes = False  # a 307 would build its Location from the Host header
    app.state.router = router
    app.add_middleware(KeyCheck, key=client_key)
    mount_router_ui(app)  # /ui: static files outside the key check; its data needs the key
    policy = guard_policy(config.listen_host, config.allowed_hosts, config.allowed_origins, "router", bool(client_key))
    app.add_middleware(LocalGuard, policy=policy)  # outermost: web pages refused before anything reads them
    return app


def health_report(router: Router, followers: list[BackendFollower], policy: str, slot: TokenizerSlot) -> dict:
    """ok: every backend up; degraded: some; down: none (503). A backend is out of rotation while it is
    unreachable or reports what the router cannot use; `error` says which."""
    rows = []
    for f in followers:
        b = f.state
        rows.append(
            {
                "url": b.url,
                "up": b.is_up,
                "error": b.error or None,
                "requests": b.num_requests,
                "pending_prefill_tokens": b.pending_prefill_tokens,
                "decode_tokens": b.decode_tokens,
                "cached_blocks": b.num_blocks,
                # replies whose cached_tokens contradicted the claimed blocks; claims ignored while > 0 s
                "claims": {"contradicted": b.num_contradictions, "ignored_s": round(b.claims_ignored_s, 1)},
                "block_size": b.block_size,
                "models": dict(b.models.states) if b.models is not None else None,
                "events": {"following": f.is_following, "epoch": f.epoch, "seq": f.seq},
            }
        )
    num_up = sum(r["up"] for r in rows)
    status = "ok" if num_up == len(rows) and rows else "degraded" if num_up else "down"
    tokenizer = "loaded" if slot.reader.tokenizer is not None else (slot.error or "not loaded yet")
    return {"status": status, "policy": policy, "tokenizer": tokenizer, "backends": rows}
