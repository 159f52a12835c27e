"""Requests for a model in a process of its own (server/model_process.py) pass through to that process:
the method, path, query, headers (the client's key replaced by the child's) and the body this server
already read and checked, and back the child's status, headers and body as they arrive (a stream's events
one by one, keep-alives included), their token counts read on the way for the request log and /metrics
(server/reply_usage.py). The client leaving closes the upstream request, and the child cancels
the generation as it does for any client. A child that is restarting is waited for (the model's start
bound); one that cannot be reached before its reply began is a 503 in the API's error shape; one that dies
mid-reply ends the reply there."""

from __future__ import annotations

import logging

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from ..errors import KVServeError
from .anthropic.reply import error_response as anthropic_error
from .gate import OWN_HEADER, OWN_KEY, PRINCIPAL_HEADER, PRINCIPAL_KEY, RECORD_KEY, error_response, note_error
from .local_guard import BROWSER_HEADERS
from .model_process import ModelProcess
from .reply_usage import USAGE_HEADER, ReplyUsage

log = logging.getLogger(__name__)

DROPPED_HEADERS = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te"})
DROPPED_HEADERS |= {name.encode() for name in BROWSER_HEADERS}  # checked here; the child sees another host
DROPPED_HEADERS |= {b"upgrade", b"trailer", b"authorization", b"x-api-key", PRINCIPAL_HEADER, OWN_HEADER}
REPLY_DROPPED = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})
TIMEOUT = httpx.Timeout(10.0, read=None)  # a long prefill sends nothing for minutes on a non-streamed reply


class ModelUnavailableError(KVServeError):
    status_code = 503
    error_type = "server_error"


def unavailable(child: ModelProcess, why: str) -> ModelUnavailableError:
    return ModelUnavailableError(f"model {child.model_name!r}: {why}", code="model_unavailable")


async def forward(child: ModelProcess, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one request (its body already read by the gate, replayed by `receive`) from `child`."""
    body = b""
    if scope["method"] in ("POST", "PUT", "PATCH"):
        body = (await receive()).get("body", b"")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in DROPPED_HEADERS]
    headers.append((b"authorization", f"Bearer {child.key}".encode()))
    if scope.get(PRINCIPAL_KEY):  # per_key isolation: the child caches for the principal this gate named
        headers.append((PRINCIPAL_HEADER, scope[PRINCIPAL_KEY].encode()))
    if scope.get(OWN_KEY):  # several keys apart, no admin key: the child's cache routes hold the key to its own
        headers.append((OWN_HEADER, scope[OWN_KEY].encode()))
    headers.append((USAGE_HEADER, b"1"))  # a stream's closing usage comment (reply_usage.py)
    query = scope.get("query_string", b"").decode("latin-1")
    started = False
    # Loopback: no TLS context (creating one costs 40-60 ms of CPU) and no proxy from the environment.
    async with httpx.AsyncClient(timeout=TIMEOUT, verify=False, trust_env=False) as client:
        for attempt in (1, 2):  # a process found dead before its reply began: once more on the next one
            if not child.ready(0) and not await anyio.to_thread.run_sync(child.ready, child.start_timeout_s):
                await _refuse(unavailable(child, "its process is not serving"), scope, send)
                return
            url, proc = child.url(scope["path"]) + (f"?{query}" if query else ""), child.proc
            try:
                request = client.build_request(scope["method"], url, headers=headers, content=body)
                reply = await client.send(request, stream=True)
                break
            except httpx.HTTPError as exc:
                if attempt == 1 and await anyio.to_thread.run_sync(child.lost, proc):
                    log.warning("model %s: its process is gone; waiting for the next one", child.model_name)
                    continue
                await _refuse(unavailable(child, f"its process failed: {exc!r}"), scope, send)
                return
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
                out = [(k, v) for k, v in reply.headers.raw if k.lower() not in REPLY_DROPPED]
                await send({"type": "http.response.start", "status": reply.status_code, "headers": out})
                started = True
                usage = ReplyUsage(scope.get(RECORD_KEY), reply.headers.get("content-type", ""))
                async for chunk in reply.aiter_raw():
                    usage.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                usage.close()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tasks.cancel_scope.cancel()
        except (httpx.HTTPError, OSError) as exc:  # the child died mid-reply, or the client left
            log.warning("model %s: reply cut: %s", child.model_name, exc)
            if started:
                return
            await _refuse(unavailable(child, f"its process failed: {exc!r}"), scope, send)
        finally:
            await reply.aclose()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _refuse(exc: KVServeError, scope: Scope, send: Send) -> None:
    note_error(scope, exc)
    reply = anthropic_error if scope["path"].startswith("/v1/messages") else error_response
    await reply(exc)(scope, _no_body, send)


async def _no_body() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}
