"""The Starlette application: OpenAI routes, /health, error mapping, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..config import ApiKeys, load_api_keys
from ..engine.engine import Engine
from ..engine.request import Event, Finished, GenerationRequest, TextDelta, TokenLogprob
from ..engine.tool_grammar import CallGrammar, UnsupportedCallFormat
from ..errors import (
    InvalidRequestError,
    KVServeError,
    NotFoundError,
    PayloadTooLargeError,
    ValidationError,
)
from . import choices, prompts, sse, tools
from . import openai as oa
from . import openai_reply as oar
from .anthropic import anthropic_routes
from .cache_routes import cache_routes
from .deadlines import Deadlines, EventTracker
from .gate import CLIENT_CLOSED, RECORD_KEY, RequestGate, error_response, note_error
from .health import HealthMonitor
from .logprobs import LogprobFormatter
from .metrics import RequestRecord, ServerMetrics
from .model_routes import model_routes
from .openai_stream import as_kvserve_error, stream_reply
from .output import ChatOutput
from .output import collect as collect_segments
from .responses_routes import responses_routes
from .router_routes import router_routes

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.2


class _NotJSON(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not a JSON value")  # Python's json takes NaN and Infinity; JSON does not


async def read_json(request: Request, limit: int, allow_empty: bool = False) -> Any:
    """The body parsed as JSON ({} for an empty one when `allow_empty`). Raises
    PayloadTooLargeError (413) past `limit`, InvalidRequestError (400) for anything else that is
    not JSON a request field can hold."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if allow_empty and not raw.strip():
        return {}
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, _NotJSON) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    except ValueError:  # the one other: an integer past int()'s digit limit (4300 by default)
        raise InvalidRequestError("request body holds an integer with too many digits to read") from None
    except RecursionError:  # a few thousand nested brackets fit in any body limit
        raise InvalidRequestError("request body is nested too deeply") from None


class CompletionHandler:
    """Turns one HTTP request into a GenerationRequest and its events into an OpenAI response."""

    def __init__(self, engine: Engine):
        self.engine = engine
        gen = engine.config.generation
        self.defaults = oa.Defaults(gen.max_tokens, gen.temperature, gen.top_p)

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", "default", self.engine.model_name):
            raise NotFoundError(
                f"model {name!r} not found; this server serves {self.engine.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def tokens(self, req: oa.CompletionRequest) -> list[int]:
        if req.kind == "chat":
            tools.check_support(self.engine.loaded.tokenizer, req.tools)
            offered = req.tools.tools if req.tools else None
            return await prompts.chat_tokens(self.engine, req.messages, True, offered, req.template_kwargs)
        if isinstance(req.prompt, list):
            prompts.check_token_ids(self.engine, req.prompt)
            return req.prompt
        return await prompts.text_tokens(self.engine, req.prompt)

    async def __call__(self, request: Request, kind: str) -> Response:
        body = await read_json(request, self.engine.config.server.max_body_bytes)
        req = oa.parse_request(body, kind, self.defaults)
        submitted = await self.submit_choices(request, req)
        gen_reqs = [gen_req for gen_req, _ in submitted]
        if req.stream:
            return sse.GenerationStream(stream_reply(self, req, submitted), *gen_reqs)
        entries: list[list[TokenLogprob]] = [[] for _ in submitted]
        waits = [self.collect(request, g, track, e) for (g, track), e in zip(submitted, entries, strict=True)]
        done = await choices.gather(waits, gen_reqs)
        if gone := next((d for d in done if isinstance(d, Response)), None):
            return gone  # the client left
        bodies = []
        for gen_req, (text, ev), logprobs in zip(gen_reqs, done, entries, strict=True):
            body = self._reply_body(req, gen_req, text, ev)
            if req.logprobs.enabled:
                body["choices"][0]["logprobs"] = self.logprob_formatter(req).block(logprobs)
            bodies.append(body)
        usage = choices.combined_usage([ev.usage for _, ev in done])
        submitted[0][1].record_usage(usage)
        body = choices.merge_bodies(bodies, oar.usage_body(usage))
        return JSONResponse(self.with_extension(body, req, gen_reqs[0]))

    def logprob_formatter(self, req: oa.CompletionRequest) -> LogprobFormatter:
        return LogprobFormatter(self.engine.loaded.tokenizer, req.kind)

    def output(self, req: oa.CompletionRequest, gen_req: GenerationRequest) -> ChatOutput:
        """The splitter of this chat reply into reasoning, content and tool calls."""
        return ChatOutput(self.engine.loaded.tokenizer, gen_req.prompt_tokens, req.tools)

    def _reply_body(self, req: oa.CompletionRequest, gen_req: GenerationRequest, text: str, ev: Finished) -> dict:
        rid, model = gen_req.request_id, self.engine.model_name
        if req.kind != "chat":
            return oar.response_body(req, rid, model, text, ev.finish_reason, ev.usage)
        out = self.output(req, gen_req)
        content, reasoning, calls = collect_segments(out.feed(text) + out.finish())
        return oar.response_body(req, rid, model, content, ev.finish_reason, ev.usage, reasoning, calls)

    async def submit(self, request: Request, req: oa.CompletionRequest) -> tuple[GenerationRequest, EventTracker]:
        """Tokenize `req`, check its limits and hand one generation of it to the engine (its `n` is
        not read: for APIs with one completion). Raises KVServeError (mapped to 4xx) for anything
        the request cannot have."""
        (submitted,) = await self.submit_choices(request, req, 1)
        return submitted

    async def submit_choices(
        self, request: Request, req: oa.CompletionRequest, n: int | None = None
    ) -> list[tuple[GenerationRequest, EventTracker]]:
        """As `submit`, for `n` completions (default: the request's `n`), in order: the first
        prefills the prompt, the others wait for its blocks (server/choices.py). Each has its own
        events and deadlines; they share the request's id (choice i > 0 as `<id>-<i>` in logs)."""
        server = self.engine.config.server
        record = request.scope.get(RECORD_KEY) or RequestRecord("-", request.method, request.url.path, time.monotonic())
        record.stream = req.stream
        n = req.n if n is None else n
        self.check_model(req.model)
        oa.check_vocabulary(req, self.engine.vocab_size)
        if n > server.max_queue:
            raise ValidationError(
                f"'n' must be at most {server.max_queue} on this server (server.max_queue), got {n}", param="n"
            )
        calls = tools.call_grammar(req.tools, req.json_schema)
        if req.json_schema is not None and calls is None:
            await self.check_schema(req.json_schema)
        prompt = await self.tokens(req)
        grammar = await self.call_grammar(prompt, calls) if calls is not None else None
        await self.touch_leases(prompt)
        oa.check_prompt_limit(req, len(prompt), server.max_prompt_tokens)
        budget = oa.completion_budget(
            req, len(prompt), self.engine.context_length, self.defaults.max_tokens, server.max_completion_tokens
        )
        loop = asyncio.get_running_loop()
        rid = oar.new_id(req.kind)
        deadlines = Deadlines(record.started, server.first_token_timeout_s, server.request_timeout_s)
        submitted: list[tuple[GenerationRequest, EventTracker]] = []
        try:
            for i in range(n):
                events: asyncio.Queue[Event] = asyncio.Queue()
                gen_req = GenerationRequest(
                    request_id=rid if i == 0 else f"{rid}-{i}",
                    prompt_tokens=prompt,
                    params=req.sampling(budget, grammar, choice=i),
                    emit=lambda ev, events=events: loop.call_soon_threadsafe(events.put_nowait, ev),
                )
                self.engine.submit(gen_req)
                submitted.append((gen_req, EventTracker(events, deadlines, record)))
        except BaseException:
            for gen_req, _ in submitted:  # a later choice was refused (queue full): the others go too
                gen_req.cancel()
            raise
        record.request_id, record.prompt_tokens = rid, len(prompt)
        return submitted

    async def touch_leases(self, prompt: list[int]) -> None:
        """cache_control pins this prompt uses live their TTL again (a no-op without leases)."""
        manager = self.engine.prefix_cache.manager
        if manager is not None and manager.pins.leases is not None and manager.pins.leases.active:
            await run_in_threadpool(self.engine.cache_admin().touch_leases, prompt)

    async def call_grammar(self, prompt: list[int], spec: CallGrammar) -> str:
        """The grammar of a reply held to its tool calls; 400 when this model's calls cannot be held."""
        try:
            return await run_in_threadpool(self.engine.call_grammar, prompt, spec)
        except UnsupportedCallFormat as exc:
            raise InvalidRequestError(f"tool_choice / strict tools: {exc}", param="tool_choice") from exc

    async def check_schema(self, schema: dict) -> None:
        """InvalidRequestError (400) for a response_format schema llguidance cannot enforce."""
        problem = await run_in_threadpool(self.engine.check_schema, schema)
        if problem:
            raise InvalidRequestError(f"response_format: {problem}", param="response_format")

    def with_extension(self, body: dict, req: oa.CompletionRequest, gen_req: GenerationRequest) -> dict:
        """Add the opt-in `kvserve` object: the prompt's block hashes, to pin exactly what was sent."""
        if req.return_block_hashes:
            manager = self.engine.prefix_cache.manager
            hashes = manager.hasher.hash_blocks(gen_req.prompt_tokens) if manager is not None else []
            body["kvserve"] = {"block_hashes": [h.hex() for h in hashes]}
        return body

    async def collect(
        self,
        request: Request,
        gen_req: GenerationRequest,
        track: EventTracker,
        logprobs: list[TokenLogprob] | None = None,
    ) -> tuple[str, Finished] | Response:
        """The whole reply's text and its Finished event, or a 499 response when the client left;
        the tokens' logprobs, when asked for, are appended to `logprobs`. Raises the KVServeError of
        a failed generation, RequestTimeoutError past a deadline."""
        pieces: list[str] = []
        loop = asyncio.get_running_loop()
        next_check = loop.time() + _DISCONNECT_POLL_S
        try:
            while True:
                # Poll by the clock: while tokens flow, events.get() never waits long enough to time out.
                if loop.time() >= next_check:
                    if await request.is_disconnected():
                        gen_req.cancel()
                        return Response(status_code=499)
                    next_check = loop.time() + _DISCONNECT_POLL_S
                ev = await track.next(_DISCONNECT_POLL_S)  # a timeout raises: 504, cancelled below
                if ev is None:
                    continue
                if isinstance(ev, TextDelta):
                    pieces.append(ev.text)
                    if logprobs is not None:
                        logprobs.extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    track.finished(ev)
                    return "".join(pieces), ev
                else:
                    err = as_kvserve_error(ev.error)
                    track.failed(err)
                    raise err
        finally:
            gen_req.cancel()  # no-op when finished; stops the worker if this task was cancelled


def create_app(engine: Engine, keys: ApiKeys | None = None) -> Starlette:
    """The app serving `engine`. `keys` default to those of engine.config (key files are read now;
    ConfigError when one cannot be)."""
    handler = CompletionHandler(engine)
    monitor = HealthMonitor(engine)
    metrics = ServerMetrics(engine)

    async def chat(request: Request) -> Response:
        return await handler(request, "chat")

    async def completions(request: Request) -> Response:
        return await handler(request, "text")

    async def health(request: Request) -> Response:
        body, status = monitor.report()
        return JSONResponse(body, status_code=status)

    async def root(request: Request) -> Response:
        # Claude Code sends `HEAD /` to its base URL before each run: a connectivity check, answered.
        return JSONResponse({"object": "server", "name": "mlx-kvserve", "model": engine.model_name})

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
        if engine.config.cache.pin_on_start:
            await run_in_threadpool(engine.pin_files, engine.config.cache.pin_on_start)
        log.info("serving %s (context %d tokens)", engine.model_name, engine.context_length)
        try:
            yield
        finally:
            log.info("shutting down: stopping the worker")
            monitor.shutting_down = True  # /health answers 503 from here on
            await run_in_threadpool(engine.stop, engine.config.server.shutdown_timeout_s)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *model_routes(engine),
        Route("/health", health, methods=["GET"]),
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        *cache_routes(engine, read_json),
        *router_routes(engine),
        *anthropic_routes(handler, read_json),
        *responses_routes(handler, read_json),
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
    app.add_middleware(
        RequestGate,
        keys=keys,
        in_flight_limit=server.in_flight_limit(),
        metrics=metrics,
        routes=app.router.routes,
        max_body_bytes=server.max_body_bytes,
        body_read_timeout_s=server.body_read_timeout_s,
    )
    return app
