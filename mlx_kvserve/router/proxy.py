"""The router's core: pick a backend for a request (seed 004's policies over the backends' state), forward
it, and pass the reply back as it arrives.

Load is counted here, as requests start and finish (never inside a picker): a request adds its expected new
prefill to the chosen backend's pending prefill until its first token, one to its requests until its last
byte, and each token event to its decode tokens. A backend that cannot be reached, answers 429/503
before any byte, or sends nothing within its timeout (UpstreamTimeouts) is skipped for the next one the
policy picks; a backend that dies or falls silent mid-stream ends that client's stream with an error event in
the stream's dialect. A backend that failed or timed out is taken out until its /health answers. The client
leaving closes the upstream request, and the backend cancels the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..chain import BlockHasher
from ..errors import KVServeError
from ..server.local_guard import BROWSER_HEADERS
from .backends import CLAIM_PENALTY_S, CLAIM_STRIKES, BackendState
from .metrics import RouterMetrics
from .models import by_model, model_not_served, model_rank
from .policies import DEFAULT_OVERLOAD_FACTOR, NoBackendError, Policy, PolicyState, RouteRequest, apply_decision, choose
from .prompts import MESSAGES_PATH, PromptInfo
from .watch import ReplyWatcher, stream_error

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 503})  # busy or shutting down: another backend may serve it now
HOP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer"}
)
AUTH_HEADERS = frozenset({"authorization", "x-api-key"})
# The browser's headers were checked here (local_guard.py); the backend would see them come from another host.
UNSENT_HEADERS = HOP_HEADERS | AUTH_HEADERS | BROWSER_HEADERS
# The backend's reply headers passed on (x-kvserve-truncated-messages: server/context_window.py).
REPLY_HEADERS = ("content-type", "retry-after", "www-authenticate", "cache-control", "x-kvserve-truncated-messages")
DISCONNECT_POLL_S = 0.2
CLIENT_CLOSED = 499


class BackendFailedError(KVServeError):
    """Every backend tried failed before answering (502)."""

    status_code = 502
    error_type = "server_error"


class BackendTimeoutError(KVServeError):
    """Every backend tried took the request and sent nothing in time (504)."""

    status_code = 504
    error_type = "server_error"


class UpstreamTimeouts(NamedTuple):
    """How long the router waits on a backend (router.connect_timeout_s, first_byte_timeout_s, read_timeout_s).

    A server sends a streamed reply's headers as soon as it takes the request, but a whole reply's only after
    its last token: so `first_byte_s` bounds the wait for a streamed reply (and for requests that generate
    nothing), `read_s` the wait for a whole reply and every silence inside a reply."""

    connect_s: float = 5.0
    first_byte_s: float = 30.0
    read_s: float = 600.0


class _ClientGone(Exception):
    pass


class _NoFirstByte(Exception):
    """The backend took the request and sent nothing within `first_byte_s`."""


@dataclass
class Route:
    """One request's place on one backend, from the decision to its last byte."""

    backend: BackendState
    new_prefill: int  # tokens the backend is expected to prefill (the prompt less the estimated hit)
    estimated_hit: int
    started: float = field(default_factory=time.monotonic)
    prefill_pending: bool = True
    decoded: int = 0
    is_finished: bool = False

    def first_token(self) -> None:
        if self.prefill_pending:
            self.prefill_pending = False
            self.backend.prefill_done(self.new_prefill)

    def finish(self) -> None:
        """Take the request off its backend's load; only the first call counts."""
        if not self.is_finished:
            self.is_finished = True
            self.backend.finish_request(self.new_prefill if self.prefill_pending else 0, self.decoded)


class _RelayResponse(StreamingResponse):
    """A streamed reply that closes its upstream even when its body never ran (the client left before the
    first byte, so the generator, and its `finally`, never started)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


class Router:
    """Decisions and forwarding for a set of backends. Everything runs on one event loop; `pick` never
    awaits, so each decision sees the load of every decision before it."""

    def __init__(
        self,
        backends: Sequence[BackendState],
        client: httpx.AsyncClient,
        policy: Policy | str = Policy.UNIFIED,
        overload_factor: float = DEFAULT_OVERLOAD_FACTOR,
        backend_headers: dict[str, str] | None = None,
        metrics: RouterMetrics | None = None,
        timeouts: UpstreamTimeouts | None = None,
    ):
        self.backends = list(backends)
        self.client = client
        self.policy = Policy(policy)
        self.overload_factor = overload_factor
        self.backend_headers = backend_headers or {}
        self.state = PolicyState()
        self.timeouts = timeouts or UpstreamTimeouts()
        self.metrics = metrics or RouterMetrics(lambda: self.backends)

    # --- decisions ----------------------------------------------------------------------------------------

    def serving(self, model: str | None, exclude: frozenset[str] = frozenset()) -> list[BackendState]:
        """The up backends not in `exclude` that serve `model` best (models.py: loaded there, else
        registered). Raises NoBackendError (503) when none is up, or none other serves it; NotFoundError
        (404, naming the models served) when no backend serves it."""
        up = [b for b in self.backends if b.is_up and b.url not in exclude]
        if not up:
            raise NoBackendError("no backend is up" if not exclude else "no other backend is up")
        chosen = [up[i] for i in by_model([model_rank(b.models, model) for b in up])]
        if not chosen:
            if exclude:
                raise NoBackendError(f"no other backend serves model {model!r}")
            raise model_not_served(str(model), [b.models for b in self.backends])
        return chosen

    def pick(self, info: PromptInfo, exclude: frozenset[str] = frozenset()) -> Route:
        """Choose among the backends that serve the request's model (`serving`) and count the request on
        the chosen one. Raises what `serving` raises."""
        candidates = self.serving(info.model, exclude)
        tokens = info.tokens or []
        hashes: dict[tuple[bytes | None, int], list[bytes]] = {}
        views = []
        for b in candidates:
            key = (b.namespace, b.block_size)
            if key not in hashes:
                hashes[key] = BlockHasher(b.namespace, b.block_size).hash_blocks(tokens) if b.namespace else []
            views.append(b.view(hashes[key]))
        request = RouteRequest(len(tokens), info.session_id)
        decision = choose(self.policy, views, request, self.state, self.overload_factor)
        apply_decision(self.state, request, decision)
        chosen = candidates[decision.index]
        hit = views[decision.index].cache_hit_tokens
        route = Route(chosen, max(0, len(tokens) - hit), hit)
        chosen.start_request(route.new_prefill)
        self.metrics.decisions.labels(self.policy.value, decision.reason.value, chosen.url).inc()
        self.metrics.estimated_cached.labels(chosen.url).inc(hit)
        return route

    def any_backend(self, exclude: frozenset[str] = frozenset(), model: str | None = None) -> BackendState:
        """An up backend not in `exclude` that serves `model`, for a request that generates nothing (model
        list, token count): the least loaded."""
        return min(self.serving(model, exclude), key=lambda b: b.num_requests)

    # --- forwarding ---------------------------------------------------------------------------------------

    def _upstream(self, request: Request, backend: BackendState, body: bytes) -> httpx.Request:
        headers = [(k, v) for k, v in request.headers.items() if k not in UNSENT_HEADERS]
        headers += list(self.backend_headers.items())
        url = backend.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        timeout = httpx.Timeout(self.timeouts.read_s, connect=self.timeouts.connect_s)
        return self.client.build_request(request.method, url, headers=headers, content=body, timeout=timeout)

    async def _send(self, request: Request, upstream: httpx.Request, first_byte_s: float | None) -> httpx.Response:
        """The backend's response headers. Raises _ClientGone (the upstream request cancelled) when the client
        leaves first, as it may while a backend computes a whole reply; _NoFirstByte past `first_byte_s`."""
        loop = asyncio.get_running_loop()
        deadline = None if first_byte_s is None else loop.time() + first_byte_s
        task = asyncio.ensure_future(self.client.send(upstream, stream=True))
        try:
            while True:
                wait = (
                    DISCONNECT_POLL_S if deadline is None else max(0.0, min(DISCONNECT_POLL_S, deadline - loop.time()))
                )
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                if deadline is not None and loop.time() >= deadline:
                    raise _NoFirstByte()
                if await request.is_disconnected():
                    raise _ClientGone()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task

    async def _open(
        self, request: Request, backend: BackendState, body: bytes, first_byte_s: float | None
    ) -> httpx.Response:
        try:
            return await self._send(request, self._upstream(request, backend, body), first_byte_s)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            # Most likely a pooled connection the backend closed as it went idle, before reading the request:
            # once more on a fresh connection before the backend is taken for down.
            return await self._send(request, self._upstream(request, backend, body), first_byte_s)

    def _describe(self, exc: Exception) -> str:
        """Why a backend failed a request, naming the setting when it was a timeout."""
        if isinstance(exc, _NoFirstByte):
            return f"no answer within router.first_byte_timeout_s ({self.timeouts.first_byte_s:g}s)"
        if isinstance(exc, httpx.ReadTimeout):
            return f"nothing sent for router.read_timeout_s ({self.timeouts.read_s:g}s)"
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def forward(
        self, request: Request, body: bytes, info: PromptInfo, generates: bool = True, searches: bool = False
    ) -> Response:
        """Send the request to a backend the policy picks, and the next on failure; the reply streams back.
        `searches`: the request names what one backend holds (a stored response), so any answer but a 200
        (a 404, or a 500 from a broken backend) asks the next up backend, and the last answer is the
        client's. Raises NoBackendError (503) when none is up,
        BackendTimeoutError (504) when every one tried timed out, BackendFailedError (502) when they failed
        otherwise."""
        tried: set[str] = set()
        failures: list[str] = []
        num_timeouts = 0
        # a server sends a streamed reply's headers at once, a whole reply's after its last token
        first_byte_s = self.timeouts.first_byte_s if info.stream or not generates else None
        while True:
            try:
                route = (
                    self.pick(info, frozenset(tried))
                    if generates
                    else Route(self.any_backend(frozenset(tried), info.model), 0, 0)
                )
            except NoBackendError:
                if failures:
                    raise _no_answer(failures, num_timeouts) from None
                raise
            backend = route.backend
            tried.add(backend.url)
            if not generates:
                backend.start_request(0)
            try:
                resp = await self._open(request, backend, body, first_byte_s)
            except _ClientGone:
                route.finish()
                self.metrics.requests.labels(backend.url, str(CLIENT_CLOSED)).inc()
                return Response(status_code=CLIENT_CLOSED)
            except (httpx.HTTPError, _NoFirstByte) as exc:
                route.finish()
                is_timeout = isinstance(exc, (_NoFirstByte, httpx.ReadTimeout, httpx.WriteTimeout))
                num_timeouts += is_timeout
                reason = self._describe(exc)
                failures.append(f"{backend.url}: {reason}")
                self._take_out(backend, "timeout" if is_timeout else "connect", f"request failed: {reason}")
                self.metrics.retries.inc()
                if not generates:
                    raise _no_answer(failures, num_timeouts) from None
                continue
            if searches and resp.status_code != 200 and self._others_up(tried):  # only a 200 found it
                await resp.aclose()
                route.finish()
                continue
            if resp.status_code in RETRY_STATUSES and generates and self._others_up(tried):
                await resp.aclose()
                route.finish()
                failures.append(f"{backend.url}: HTTP {resp.status_code}")
                self.metrics.retries.inc()
                continue
            if resp.status_code == 200:
                backend.note_loaded(info.model)  # loaded there now: the next request need not wait for /health
            return self._relay(request, resp, route, info)

    def _others_up(self, tried: set[str]) -> bool:
        return any(b.is_up and b.url not in tried for b in self.backends)

    def _take_out(self, backend: BackendState, kind: str, reason: str) -> None:
        log.warning("backend %s is out of rotation: %s", backend.url, reason)
        backend.mark_down(reason)
        self.metrics.failures.labels(backend.url, kind).inc()

    def _relay(self, request: Request, resp: httpx.Response, route: Route, info: PromptInfo) -> Response:
        is_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
        headers = {k: resp.headers[k] for k in REPLY_HEADERS if k in resp.headers}
        headers["x-kvserve-backend"] = route.backend.url
        body = self._relay_body(request.url.path, resp, route, ReplyWatcher(is_stream))
        on_close = lambda: self._close(resp, route, str(CLIENT_CLOSED))  # noqa: E731
        return _RelayResponse(body, on_close, status_code=resp.status_code, headers=headers)

    async def _relay_body(
        self, path: str, resp: httpx.Response, route: Route, watcher: ReplyWatcher
    ) -> AsyncIterator[bytes]:
        backend, status = route.backend, str(resp.status_code)
        try:
            async for chunk in resp.aiter_raw():
                tokens = watcher.feed(chunk)
                if tokens:
                    if route.prefill_pending:
                        route.first_token()
                        self.metrics.ttft.labels(backend.url).observe(time.monotonic() - route.started)
                    backend.decoded(tokens)
                    route.decoded += tokens
                yield chunk
            watcher.finish()
            self._observe_usage(route, watcher)
        except httpx.HTTPError as exc:  # the backend died mid-reply: the status is sent, end it clearly
            status = "504" if isinstance(exc, httpx.ReadTimeout) else "502"
            reason = self._describe(exc)
            self._take_out(backend, "mid_reply", f"reply cut short: {reason}")
            if watcher.is_stream:
                yield stream_error(path.startswith(MESSAGES_PATH), f"the backend failed mid-reply ({reason})")
        except BaseException:  # cancelled: the client left; closing the response tells the backend
            status = str(CLIENT_CLOSED)
            raise
        finally:
            await self._close(resp, route, status)

    async def _close(self, resp: httpx.Response, route: Route, status: str) -> None:
        """Close the upstream reply (the backend sees its client leave) and count the request done, once."""
        if route.is_finished:
            return
        route.finish()
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        self.metrics.requests.labels(route.backend.url, status).inc()
        self.metrics.duration.labels(route.backend.url).observe(time.monotonic() - route.started)

    def _observe_usage(self, route: Route, watcher: ReplyWatcher) -> None:
        url = route.backend.url
        if watcher.prompt_tokens is not None:
            self.metrics.prompt_tokens.labels(url).inc(watcher.prompt_tokens)
            self.metrics.reported_cached.labels(url).inc(watcher.cached_tokens or 0)
            if route.backend.check_claim(route.estimated_hit, watcher.cached_tokens or 0):
                log.warning(
                    "backend %s reported fewer cached tokens than its blocks claimed, %d times in a row: "
                    "its claims are ignored for %gs",
                    url,
                    CLAIM_STRIKES,
                    CLAIM_PENALTY_S,
                )


def _no_answer(failures: list[str], num_timeouts: int) -> KVServeError:
    """504 when every backend tried timed out, else 502; the message names each failure."""
    error = BackendTimeoutError if num_timeouts == len(failures) else BackendFailedError
    return error(f"no backend answered: {'; '.join(failures)}")
