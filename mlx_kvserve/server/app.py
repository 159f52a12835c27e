"""The Starlette application: the routes table, the lifespan (the engine's worker started and stopped)
and the one mapping of errors to responses. Bodies are read in bodies.py, completions served by
completion.py, each API's shapes in openai/, anthropic/ and responses/."""

from __future__ import annotations

import contextlib
import logging
import os

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..config import ApiKeys, load_api_keys
from ..engine.front import EngineFront
from ..errors import ConfigError, InvalidRequestError, KVServeError, NotFoundError
from ..registry.registry import ModelRegistry
from . import prompt_bound
from .anthropic.routes import anthropic_routes
from .cache_routes import cache_routes
from .completion import CompletionHandler
from .context_window import TruncationHeader
from .embeddings import embedding_routes
from .gate import CLIENT_CLOSED, PRINCIPAL_HEADER_ENV, RequestGate, error_response, note_error
from .health import HealthMonitor
from .local_guard import LocalGuard, guard_policy
from .metrics import ServerMetrics
from .model_routes import model_routes
from .model_select import ModelSelect
from .models_admin import RegistryCollector, models_routes
from .openai.routes import openai_routes
from .responses.routes import responses_routes
from .root_page import dashboard_url, root_response
from .router_routes import router_routes
from .ui_routes import mount_ui

log = logging.getLogger(__name__)


def create_app(engine: EngineFront, keys: ApiKeys | None = None, registry: ModelRegistry | None = None) -> Starlette:
    """The app serving `engine`. `keys` default to those of engine.config (key files are read now;
    ConfigError when one cannot be). With several models, `registry` and its front
    (registry/front.py) as `engine`: each request is served by the model it names."""
    handler = CompletionHandler(engine)
    monitor = HealthMonitor(engine)
    metrics = ServerMetrics(engine)

    async def health(request: Request) -> Response:
        body, status = monitor.report()
        return JSONResponse(body, status_code=status)

    async def root(request: Request) -> Response:
        return root_response(request, engine.model_name)  # links to /ui and the API (root_page.py)

    async def metrics_text(request: Request) -> Response:
        text = await run_in_threadpool(metrics.render)  # reads the cache stats under their locks
        return Response(text, media_type=metrics.content_type)

    async def on_kvserve_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KVServeError)
        note_error(request.scope, exc)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kinds = {404: NotFoundError, 405: InvalidRequestError}
        err = kinds.get(exc.status_code, InvalidRequestError)(f"{request.method} {request.url.path}: {exc.detail}")
        err.status_code = exc.status_code
        note_error(request.scope, err)
        return error_response(err)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # The gate reads bodies first, so this is a backstop: a client that left is not a server error.
        return Response(status_code=CLIENT_CLOSED)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(KVServeError(f"internal error: {type(exc).__name__}"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        if registry is None:  # the prompt size bound of its tokenizer, before the first request needs it
            await run_in_threadpool(prompt_bound.max_token_bytes, getattr(engine, "tokenizer", None))
        if engine.config.cache.pin_on_start:
            await run_in_threadpool(engine.pin_files, engine.config.cache.pin_on_start)
        log.info("serving %s (context %d tokens)", engine.model_name, engine.context_length)
        log.info("dashboard: %s", dashboard_url(engine.config.server.host, engine.config.server.port))
        try:
            yield
        finally:
            log.info("shutting down: stopping the worker")
            monitor.shutting_down = True  # /health answers 503 from here on
            await run_in_threadpool(engine.stop, engine.config.server.shutdown_timeout_s)

    routes = [
        *openai_routes(handler),
        *(model_routes(engine) if registry is None else models_routes(registry, engine.config.server.max_body_bytes)),
        Route("/health", health, methods=["GET"]),
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/api/hello", root, methods=["GET", "HEAD"]),  # Claude Code's connectivity check
        Route("/metrics", metrics_text, methods=["GET"]),
        *cache_routes(engine),
        *router_routes(engine),
        *anthropic_routes(handler),
        *responses_routes(handler),
        *embedding_routes(engine),
    ]
    handlers = {
        KVServeError: on_kvserve_error,
        HTTPException: on_http_error,
        ClientDisconnect: on_client_gone,
        Exception: on_unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    # A trailing slash is a 404, as documented: Starlette's redirect would build its Location from the
    # Host header (an open redirect), and clients do not resend a POST body after a 307 anyway.
    app.router.redirect_slashes = False
    keys = keys if keys is not None else load_api_keys(engine.config.server)
    server = engine.config.server
    app.add_middleware(TruncationHeader)  # innermost: it reads the scope the handler wrote
    if registry is not None:  # added before the gate, so it runs inside it (on the body the gate read)
        app.add_middleware(ModelSelect, registry=registry)
        metrics.registry.register(RegistryCollector(registry))
    cache = engine.config.cache
    isolate = keys.isolated(cache.isolation)
    handler.cached_block = cache.block_size if keys.whole_blocks(cache.isolation, cache.report_cached) else 0
    if isolate:
        if registry is None and getattr(engine, "world", None) is not None:  # (a registry has no ranks)
            raise ConfigError('cache.isolation: "per_key" does not work with --distributed yet; set "shared"')
        names = [p.name for p in keys.named()] + (["admin"] if keys.admin else [])
        if names:
            log.info("cache isolation per_key: each key caches apart (%s)", ", ".join(names))
        else:
            log.warning("cache.isolation is per_key but no API key is set: every request shares one cache")
    app.add_middleware(
        RequestGate,
        keys=keys,
        isolate=isolate,
        trust_principal_header=bool(os.environ.get(PRINCIPAL_HEADER_ENV)),
        in_flight_limit=server.in_flight_limit(),
        metrics=metrics,
        routes=app.router.routes,
        max_body_bytes=server.max_body_bytes,
        body_read_timeout_s=server.body_read_timeout_s,
    )
    mount_ui(app)  # /ui outside the gate (static files, no data); its requests log inside it
    # Outermost: a web page's request is refused before anything else reads it, /ui's included.
    policy = guard_policy(server.host, server.allowed_hosts, server.allowed_origins, "server", bool(keys.inference))
    app.add_middleware(LocalGuard, policy=policy)
    return app
