"""The OpenAI Responses API routes: `POST /v1/responses` (whole or streamed), `GET` and `DELETE
/v1/responses/{id}`. A request is translated into an OpenAI chat request (parse.py) and served by
the one CompletionHandler path, as `/v1/chat/completions` is: same template, same engine, same block
cache.

Stored responses (`store`, true by default) are kept in RAM (store.py), least recently used dropped
first past a count and a byte bound: a follow-up naming one in `previous_response_id` continues its
conversation, so its prompt starts with the earlier prompt and that prefix is served from the cache.

So that the follow-up finds it there, a stored response leases its prompt and output tokens' blocks
for LEASE_TTL_S (Anthropic's default `cache_control` TTL), through the same lease path as
`cache_control` (CacheAdmin.lease: within [cache] cache_control_share, refreshed by each use, kept in
RAM only by a guest server). A `prompt_cache_key` leases the request's prompt the same way, stored or
not. A response dropped from the store or deleted leaves its lease to expire by itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine.request import Finished, GenerationRequest, TextDelta
from ...errors import KVServeError, RequestTimeoutError
from .. import cache_control, sse
from ..bodies import read_json
from ..completion import CompletionHandler
from ..deadlines import EventTracker
from ..gate import PRINCIPAL_KEY, error_response, note_error
from ..openai import parse as oa
from . import parse as rs
from .reply import OutputItems, Sequencer, finish_status, new_id, response_body, usage_body
from .store import ResponseStore

LEASE_TTL_S = cache_control.TTL_S["5m"]  # how long a stored response's or a prompt_cache_key's prefix is pinned


def responses_routes(handler: CompletionHandler, store: ResponseStore | None = None) -> list[Route]:
    """/v1/responses and /v1/responses/{id}, served by `handler` (the OpenAI chat path)."""
    engine = handler.engine
    store = store if store is not None else ResponseStore()

    def owner(request: Request) -> str:
        """Whose stored responses this request may read: its key's principal under per_key isolation."""
        return request.scope.get(PRINCIPAL_KEY, "")

    def failed(request: Request, exc: KVServeError) -> Response:
        exc = rs.renamed(exc)
        note_error(request.scope, exc)
        return error_response(exc)

    def reasoning_tokens(items: OutputItems) -> int:
        text = items.reasoning_text
        return len(engine.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def lease(tokens: Sequence[int], gen_req: GenerationRequest) -> int:
        """Pin the full blocks of `tokens` (which start with gen_req's prompt) for LEASE_TTL_S (0
        while the cache is off)."""
        if not engine.cache_enabled or not tokens:
            return 0

        def grant() -> int:
            # A prompt shorter than a block has no chain to go on from: the principal's starts at its
            # root (per_key isolation), never in the plain namespace.
            known = gen_req.block_hashes or engine.block_hashes(list(tokens), gen_req.principal)
            return engine.cache_admin().lease(list(tokens), LEASE_TTL_S, known)

        return await run_in_threadpool(grant)

    async def finished_body(
        rid: str, parsed: rs.ResponsesRequest, items: OutputItems, gen_req: GenerationRequest, ev: Finished
    ) -> dict:
        """The finished Response object; stored (its conversation's tokens leased) when asked, as its
        principal's (gen_req.principal: per_key isolation)."""
        status = finish_status(ev.finish_reason)
        usage_json = usage_body(ev.usage, reasoning_tokens(items))
        body = response_body(rid, engine.model_name, parsed.echo, status, items.items, usage_json)
        if parsed.store:
            store.put(body, parsed.items, gen_req.principal)
            # The prompt and what was generated: a follow-up's prompt starts with them, as far as the
            # template renders the reply as generated (the prompt's blocks at least).
            await lease([*gen_req.prompt_tokens, *ev.token_ids], gen_req)
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
        try:
            body = await read_json(request, engine.config.server.max_body_bytes)
            prev = rs.previous_id(body)
            parsed = rs.parse(body, store.history(prev, owner(request)) if prev else [])
            req = oa.parse_request(parsed.chat, "chat", handler.defaults)

            async def lease_prompt(gen_req: GenerationRequest) -> None:
                if parsed.prompt_cache_key is not None:
                    await lease(gen_req.prompt_tokens, gen_req)

            def stream(gen_req: GenerationRequest, track: EventTracker, _: None) -> AsyncIterator[str]:
                return events(req, gen_req, track, parsed)

            done = await handler.complete(request, req, stream, lease_prompt)
        except KVServeError as exc:
            return failed(request, exc)
        if isinstance(done, Response):  # streamed, or the client left
            return done
        out, items = handler.output(req, done.gen_req), OutputItems(parsed.summary)
        items.feed(out.feed(done.text) + out.finish())
        items.finish(finish_status(done.finished.finish_reason))
        return JSONResponse(await finished_body(new_id("resp"), parsed, items, done.gen_req, done.finished))

    async def retrieve(request: Request) -> Response:
        try:
            return JSONResponse(store.get(request.path_params["response_id"], owner=owner(request)).body)
        except KVServeError as exc:
            return failed(request, exc)

    async def delete(request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            store.delete(rid, owner(request))
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
