"""The OpenAI Responses API routes: `POST /v1/responses` (whole or streamed), `GET` and `DELETE
/v1/responses/{id}`. A request is translated into an OpenAI chat request (server/responses.py) and
served by the same CompletionHandler path as `/v1/chat/completions`: same template, same engine,
same block cache.

Stored responses (`store`, true by default) are kept in RAM, least recently used dropped first past
a count and a byte bound: a follow-up naming one in `previous_response_id` continues its
conversation, so its prompt starts with the earlier prompt and that prefix is served from the cache.

So that the follow-up finds it there, a stored response leases its prompt and output tokens' blocks
for LEASE_TTL_S (Anthropic's default `cache_control` TTL), through the same lease path as
`cache_control` (CacheAdmin.lease: within [cache] cache_control_share, refreshed by each use, kept in
RAM only by a guest server). A `prompt_cache_key` leases the request's prompt the same way, stored or
not. A response dropped from the store or deleted leaves its lease to expire by itself.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.request import Finished, GenerationRequest, TextDelta
from ..errors import KVServeError, NotFoundError, RequestTimeoutError
from . import cache_control, sse
from . import openai as oa
from . import responses as rs
from .deadlines import EventTracker
from .gate import error_response, note_error
from .responses_reply import OutputItems, Sequencer, finish_status, new_id, response_body, usage_body

if TYPE_CHECKING:
    from .app import CompletionHandler

MAX_STORED = 256
MAX_STORED_BYTES = 64 * 1024 * 1024
LEASE_TTL_S = cache_control.TTL_S["5m"]  # how long a stored response's or a prompt_cache_key's prefix is pinned


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as returned
    items: list[dict[str, Any]]  # the conversation's input items before this response's output
    nbytes: int


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
    `max_entries` and about `max_bytes` of JSON, the least recently used dropped first (one
    response larger than `max_bytes` is not kept at all)."""

    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # guarded by _lock
        self._bytes = 0  # guarded by _lock: the sum of the entries' nbytes

    def put(self, body: dict[str, Any], items: list[dict[str, Any]]) -> None:
        nbytes = len(json.dumps(body)) + len(json.dumps(items))
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries[body["id"]] = StoredResponse(body, items, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def get(self, rid: str, param: str | None = None) -> StoredResponse:
        """The stored response `rid` (now the most recently used); NotFoundError (404) if none."""
        with self._lock:
            found = self._entries.get(rid)
            if found is not None:
                self._entries.move_to_end(rid)
                return found
        raise NotFoundError(f"response with id {rid!r} not found", param=param, code="response_not_found")

    def delete(self, rid: str) -> None:
        """Forget `rid`; NotFoundError (404) if it is not stored."""
        with self._lock:
            found = self._entries.pop(rid, None)
            if found is not None:
                self._bytes -= found.nbytes
                return
        raise NotFoundError(f"response with id {rid!r} not found", code="response_not_found")

    def history(self, rid: str) -> list[dict[str, Any]]:
        """The conversation a follow-up to `rid` continues: its input items, then its output."""
        found = self.get(rid, param="previous_response_id")
        return found.items + found.body["output"]


def responses_routes(
    handler: CompletionHandler, read_json: Callable, store: ResponseStore | None = None
) -> list[Route]:
    """/v1/responses and /v1/responses/{id}, served by `handler` (the OpenAI chat path)."""
    engine = handler.engine
    store = store if store is not None else ResponseStore()

    def failed(request: Request, exc: KVServeError) -> Response:
        exc = rs.renamed(exc)
        note_error(request.scope, exc)
        return error_response(exc)

    def reasoning_tokens(items: OutputItems) -> int:
        text = items.reasoning_text
        return len(engine.loaded.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def lease(tokens: Sequence[int]) -> int:
        """Pin the full blocks of `tokens` for LEASE_TTL_S (0 while the cache is off)."""
        if engine.prefix_cache.manager is None or not tokens:
            return 0
        return await run_in_threadpool(engine.cache_admin().lease, list(tokens), LEASE_TTL_S)

    async def finished_body(
        rid: str, parsed: rs.ResponsesRequest, items: OutputItems, gen_req: GenerationRequest, ev: Finished
    ) -> dict:
        """The finished Response object; stored (its conversation's tokens leased) when asked."""
        status = finish_status(ev.finish_reason)
        usage_json = usage_body(ev.usage, reasoning_tokens(items))
        body = response_body(rid, engine.model_name, parsed.echo, status, items.items, usage_json)
        if parsed.store:
            store.put(body, parsed.items)
            # The prompt and what was generated: a follow-up's prompt starts with them, as far as the
            # template renders the reply as generated (the prompt's blocks at least).
            await lease([*gen_req.prompt_tokens, *ev.token_ids])
        return body

    async def events(
        req: oa.CompletionRequest, gen_req: GenerationRequest, track: EventTracker, parsed: rs.ResponsesRequest
    ) -> AsyncIterator[str]:
        rid, seq, items, out = new_id("resp"), Sequencer(), OutputItems(parsed.summary), handler.output(req, gen_req)
        start = response_body(rid, engine.model_name, parsed.echo, "in_progress", [])
        try:
            for line in seq.lines(
                [("response.created", {"response": start}), ("response.in_progress", {"response": start})]
            ):
                yield line
            while True:
                try:
                    ev = await sse.next_or_keep_alive(track)
                except RequestTimeoutError as exc:
                    yield seq.lines([_failure(start, exc)])[0]
                    return
                if ev is sse.KEEP_ALIVE:  # a long prefill: bytes on the wire so the client waits
                    yield sse.COMMENT_KEEP_ALIVE
                elif isinstance(ev, TextDelta):
                    for line in seq.lines(items.feed(out.feed(ev.text)) if ev.text else []):
                        yield line
                elif isinstance(ev, Finished):
                    track.finished(ev)
                    status = finish_status(ev.finish_reason)
                    closing = items.feed(out.finish()) + items.finish(status)
                    body = await finished_body(rid, parsed, items, gen_req, ev)
                    for line in seq.lines([*closing, (f"response.{status}", {"response": body})]):
                        yield line
                    return
                else:
                    err = (
                        ev.error
                        if isinstance(ev.error, KVServeError)
                        else KVServeError(f"generation failed: {ev.error}")
                    )
                    track.failed(err)
                    yield seq.lines([_failure(start, err)])[0]
                    return
        finally:
            gen_req.cancel()

    async def create(request: Request) -> Response:
        gen_req = None
        try:
            body = await read_json(request, engine.config.server.max_body_bytes)
            prev = rs.previous_id(body)
            parsed = rs.parse(body, store.history(prev) if prev else [])
            req = oa.parse_request(parsed.chat, "chat", handler.defaults)
            gen_req, track = await handler.submit(request, req)
            if parsed.prompt_cache_key is not None:
                await lease(gen_req.prompt_tokens)
            if req.stream:
                return sse.GenerationStream(events(req, gen_req, track, parsed), gen_req)
            done = await handler.collect(request, gen_req, track)
        except BaseException as exc:
            if gen_req is not None:
                gen_req.cancel()  # failed after the submission: the generation must not run on for nobody
            if isinstance(exc, KVServeError):
                return failed(request, exc)
            raise
        if isinstance(done, Response):  # the client left
            return done
        text, ev = done
        out, items = handler.output(req, gen_req), OutputItems(parsed.summary)
        items.feed(out.feed(text) + out.finish())
        items.finish(finish_status(ev.finish_reason))
        return JSONResponse(await finished_body(new_id("resp"), parsed, items, gen_req, ev))

    async def retrieve(request: Request) -> Response:
        try:
            return JSONResponse(store.get(request.path_params["response_id"]).body)
        except KVServeError as exc:
            return failed(request, exc)

    async def delete(request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            store.delete(rid)
        except KVServeError as exc:
            return failed(request, exc)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
    ]


def _failure(start: dict[str, Any], exc: KVServeError) -> tuple[str, dict[str, Any]]:
    """The response.failed event for a stream that fails after it started."""
    code = "rate_limit_exceeded" if exc.status_code == 429 else "server_error"
    return "response.failed", {
        "response": start | {"status": "failed", "error": {"code": code, "message": exc.message}}
    }
