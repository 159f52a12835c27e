"""The gate every HTTP request passes: API keys, the in-flight limit, and one RequestRecord per
request that ends as metrics and a structured log line. Also the one place where a KVServeError
becomes an HTTP response.

An ASGI middleware rather than per-route code, so that routes added elsewhere (the cache admin
routes under /v1/cache/) are covered by path, and so that a streaming response holds its in-flight
slot until its last byte (or its client's disconnect).

The gate reads a request's whole body (bounded by server.max_body_bytes and
server.body_read_timeout_s) before it takes an in-flight slot, then replays it to the app: a client
that uploads slowly, or stops half-way, holds a connection but never a slot.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from contextvars import ContextVar

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..api_keys import ApiKeys, Principal
from ..errors import (
    AuthenticationError,
    BodyTimeoutError,
    KVServeError,
    OverloadedError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from .metrics import RequestRecord, ServerMetrics
from .openai import reply as oar

RECORD_KEY = "mlx_kvserve.record"  # the scope key under which handlers find their RequestRecord
# The scope key holding the identity of the principal whose key opened the request, when each key
# caches apart ([cache] isolation = "per_key"); "" (or absent): the plain namespace. Set here only:
# no client field or header can choose it.
PRINCIPAL_KEY = "mlx_kvserve.principal"
# The same principal for code without the scope (the token memo); set per request task, "" when shared.
PRINCIPAL: ContextVar[str] = ContextVar("mlx_kvserve_principal", default="")
# A model's own process (server/model_process.py) serves the principals of the parent, whose only
# client it is: the parent names each request's principal in this header, which the child reads when
# the parent set PRINCIPAL_HEADER_ENV in its environment (and every other server ignores).
PRINCIPAL_HEADER = b"x-kvserve-principal"
PRINCIPAL_HEADER_ENV = "MLX_KVSERVE_PRINCIPAL_HEADER"
# ... and says, in this one, that a /v1/cache/ request may reach only its principal's own (OWN_KEY below).
OWN_HEADER = b"x-kvserve-own-cache"
OPEN_PATHS = frozenset({"/health"})  # answered without a key: service managers and probes hold none
# Paths that hold an in-flight slot: the completion routes, count_tokens, whose chat template
# rendering of a body of up to max_body_bytes costs as much CPU as a completion's, and embeddings.
LIMITED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/embeddings",
    }
)
ADMIN_PREFIX = "/v1/cache"
# With several inference keys caching apart and no admin key, /v1/cache/ opens with every key but
# reaches only the caller's own: these routes serve a key its own part (the scope's OWN_KEY names it:
# the requests list filtered, pins by its own prompts only); every other /v1/cache/ route reaches all
# keys' caches (flush, prune, the pin list's hashes, the router's events, loading models) and is 403.
OWN_KEY = "mlx_kvserve.own_cache"
OWN_CACHE_ROUTES = frozenset(
    {
        ("GET", "/v1/cache/stats"),  # counts only, as /metrics
        ("GET", "/v1/cache/requests"),
        ("GET", "/v1/cache/layout"),  # the namespace and block size: the same for every key
        ("GET", "/v1/cache/models"),
        ("POST", "/v1/cache/pin"),
        ("POST", "/v1/cache/unpin"),
    }
)
# Polled often (by probes, and by /ui every second or five): their lines are logged at debug level.
QUIET_ENDPOINTS = frozenset({"/health", "/metrics", "/v1/cache/requests", "/v1/cache/pins"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # requests whose body the gate reads before the app runs
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded, never sent (nobody is left to read it)
request_log = logging.getLogger("mlx_kvserve.requests")

_HEADERS = {
    429: {"Retry-After": "1"},
    503: {"Retry-After": "1"},
    401: {"WWW-Authenticate": "Bearer"},
    408: {"Connection": "close"},  # the rest of the body may still be on its way: this connection is done
}


def error_response(exc: KVServeError) -> JSONResponse:
    # A message may quote request text holding a lone surrogate, which UTF-8 cannot encode.
    message = exc.message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = oar.error_body(message, exc.error_type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status_code, headers=_HEADERS.get(exc.status_code))


def note_error(scope: Scope, exc: KVServeError) -> None:
    """Name `exc` on the request's log line and metrics: for the errors the app answers, as the gate
    does for its own."""
    record = scope.get(RECORD_KEY)
    if record is not None:
        record.error = exc.code or exc.error_type


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def _bearer_token(scope: Scope) -> bytes:
    """The key of `Authorization: Bearer <key>`, or of `x-api-key` (what Anthropic clients send)."""
    found = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
        if name == b"x-api-key":
            found = value.strip()
    return found


def log_line(record: RequestRecord) -> str:
    """`key=value` pairs, one request per line; values never contain spaces."""
    ttft = "-" if record.first_token_s is None else f"{record.first_token_s:.3f}"
    return (
        f"id={record.request_id} method={record.method} endpoint={record.endpoint} status={record.status} "
        f"stream={str(record.stream).lower()} prompt_tokens={record.prompt_tokens} "
        f"cached_tokens={record.cached_tokens} completion_tokens={record.completion_tokens} ttft_s={ttft} "
        f"duration_s={record.duration_s:.3f} error={record.error or '-'} key={record.key_name or '-'}"
    )


def _header(scope: Scope, wanted: bytes) -> bytes:
    return next((value for name, value in scope["headers"] if name == wanted), b"")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            # More digits than any real length (and than int() converts): the streamed size decides.
            return int(value) if value.isdigit() and len(value) <= 18 else None
    return None


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app `body` as one message, then passes on to `receive` (which
    reports the client's disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_replayed() -> Message:
        return pending.pop() if pending else await receive()

    return receive_replayed


class RequestGate:
    """ASGI middleware. Per HTTP request: check the API key its path needs (401), read the whole
    body of a POST (413 past `max_body_bytes`, 408 past `body_read_timeout_s`, 499 recorded when the
    client leaves first), admit a request to LIMITED_PATHS only while fewer than `in_flight_limit` are
    in flight (429), then run the app with the body replayed and record the outcome. `in_flight` is
    only touched on the event loop, so it needs no lock."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        in_flight_limit: int,
        metrics: ServerMetrics,
        routes: list[BaseRoute],
        max_body_bytes: int,
        body_read_timeout_s: float,
        isolate: bool = False,
        trust_principal_header: bool = False,
    ):
        self.app = app
        self.routes = routes  # the app's live route list, to name the endpoint of a request the gate rejected
        self.keys = ApiKeys(keys.inference.encode(), keys.admin.encode())
        # (key, principal) per inference key, and the admin key's: who a request is, when `isolate`.
        self.principals = [(p.key.encode(), p) for p in keys.named()]
        admin = keys.admin_principal()
        self.admin = [(keys.admin.encode(), admin)] if admin is not None else []
        self.isolate = isolate
        # Keys apart, several of them, none an admin's: /v1/cache/ reaches only each key's own.
        self.own_cache_only = isolate and len(self.principals) > 1 and not keys.admin
        self.trust_principal_header = trust_principal_header  # a model's process: the parent names principals
        self.in_flight_limit = in_flight_limit
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.metrics = metrics
        self.in_flight = 0
        metrics.track_in_flight(lambda: self.in_flight)

    def accepted_keys(self, path: str) -> list[tuple[bytes, Principal]]:
        """(key, principal) for each key that opens `path`; [] = no key needed. The admin key also
        opens every other path."""
        if path in OPEN_PATHS:
            return []
        if is_admin_path(path) and self.keys.admin:
            return self.admin
        return self.principals + self.admin if self.keys.inference else []

    def check_key(self, scope: Scope) -> None:
        """Raise AuthenticationError unless the request holds a key its path accepts; with `isolate`,
        name its principal in the scope (PRINCIPAL_KEY)."""
        accepted = self.accepted_keys(scope["path"])
        if not accepted:
            return
        token = _bearer_token(scope)
        # compare_digest against every accepted key: the time taken says nothing about which one was close.
        matches = [hmac.compare_digest(token, key) for key, _ in accepted]
        if any(matches):
            principal = accepted[matches.index(True)][1]
            record = scope.get(RECORD_KEY)
            if record is not None:
                record.key_name = principal.name
            if self.isolate:
                named = _header(scope, PRINCIPAL_HEADER) if self.trust_principal_header else b""
                scope[PRINCIPAL_KEY] = named.decode("ascii", "replace") or principal.identity
                PRINCIPAL.set(scope[PRINCIPAL_KEY])
            if self.own_cache_only and is_admin_path(scope["path"]):
                self.check_own_cache(scope, principal)
            elif self.trust_principal_header and _header(scope, OWN_HEADER):  # the parent checked the path
                scope[OWN_KEY] = _header(scope, OWN_HEADER).decode("ascii", "replace")
            return
        what = "admin API key" if is_admin_path(scope["path"]) and self.keys.admin else "API key"
        detail = "a wrong" if token else "no"
        raise AuthenticationError(
            f"this endpoint needs the server's {what} as 'Authorization: Bearer <key>'; the request has {detail} key",
            code="invalid_api_key",
        )

    def check_own_cache(self, scope: Scope, principal: Principal) -> None:
        """Mark a /v1/cache/ request as reaching `principal`'s own only (OWN_KEY), or raise
        PermissionDeniedError (403) for a route that reaches every key's cache."""
        if (scope["method"], scope["path"]) in OWN_CACHE_ROUTES:
            scope[OWN_KEY] = principal.name
            return
        raise PermissionDeniedError(
            f"{scope['method']} {scope['path']} reaches every key's cache, which with several API keys "
            "caching apart needs the admin key: set server.admin_api_key (or admin_api_key_file)",
            code="admin_key_required",
        )

    def admit(self, scope: Scope) -> bool:
        """Take an in-flight slot for a POST to LIMITED_PATHS (True), or none for other paths (False)."""
        if scope["path"] not in LIMITED_PATHS or scope["method"] != "POST":
            return False
        if self.in_flight >= self.in_flight_limit:
            raise OverloadedError(f"{self.in_flight_limit} requests are already in flight; retry shortly")
        self.in_flight += 1
        return True

    async def read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request's whole body. Raises PayloadTooLargeError (413) past max_body_bytes, by its
        Content-Length or as it arrives; BodyTimeoutError (408) when it has not all arrived within
        body_read_timeout_s; ClientDisconnect when the client goes away first."""
        limit = self.max_body_bytes
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        chunks, size, more = [], 0, True
        with anyio.move_on_after(self.body_read_timeout_s):
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
                more = message.get("more_body", False)
        if more:
            raise BodyTimeoutError(
                f"the request body did not arrive within server.body_read_timeout_s "
                f"({self.body_read_timeout_s:g}s); {size} bytes came",
                code="body_timeout",
            )
        return b"".join(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord("req-" + uuid.uuid4().hex[:24], scope["method"], scope["path"], time.monotonic())
        scope[RECORD_KEY] = record

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                if record.status == CLIENT_CLOSED:  # a route saw the client leave (never reaches anyone)
                    record.error = record.error or "client_closed"
            await send(message)

        admitted = False
        try:
            try:
                self.check_key(scope)
                if scope["method"] in BODY_METHODS:  # before admit: a slow upload never holds a slot
                    receive = replay(await self.read_body(scope, receive), receive)
                admitted = self.admit(scope)
            except KVServeError as exc:
                note_error(scope, exc)
                await error_response(exc)(scope, receive, send_recording)
                return
            except ClientDisconnect:  # gone mid-upload: nothing to answer, nothing went wrong here
                record.status, record.error = CLIENT_CLOSED, "client_closed"
                return
            await self.app(scope, receive, send_recording)
        except BaseException as exc:
            # No response started: the client went away (cancelled) or the app raised; the
            # outer server-error middleware answers 500 to the latter.
            if not record.status:
                failed = isinstance(exc, Exception)
                record.status = 500 if failed else CLIENT_CLOSED
                record.error = record.error or ("server_error" if failed else "client_closed")
            raise
        finally:
            if admitted:
                self.in_flight -= 1
            self.finish(scope, record)

    def finish(self, scope: Scope, record: RequestRecord) -> None:
        route = scope.get("route") or next((r for r in self.routes if r.matches(scope)[0] != Match.NONE), None)
        record.endpoint = getattr(route, "path", None) or "other"  # never the raw path: unknown paths are unbounded
        record.duration_s = time.monotonic() - record.started
        self.metrics.observe(record)
        level = logging.DEBUG if record.endpoint in QUIET_ENDPOINTS else logging.INFO
        request_log.log(level, "%s", log_line(record))
