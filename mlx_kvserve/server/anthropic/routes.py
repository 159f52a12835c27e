"""The Anthropic Messages API routes: `POST /v1/messages` (whole or streamed) and
`/v1/messages/count_tokens`. A request is translated into an OpenAI chat request (parse.py) and served
by the one CompletionHandler path (same template, same engine, same block cache).

`cache_control` markers pin the marked prefix for their TTL (server/cache_control.py). Everything that
can refuse a request is checked before its generation is submitted; a failure after that cancels the
generation (CompletionHandler.complete), so no reply runs on for a request answered with an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine.request import GenerationRequest
from ...errors import KVServeError
from ...formats.output import REASONING
from .. import cache_control, prompts
from ..bodies import read_json
from ..completion import CompletionHandler
from ..deadlines import EventTracker
from ..gate import note_error
from ..messages import parse_messages
from ..openai import parse as oa
from ..slots import Slots
from .context import PromptSize, measures_prompt
from .parse import thinking_wanted, to_openai
from .reply import (
    content_blocks,
    error_response,
    matched_stop,
    message_body,
    new_message_id,
    stop_reason,
    stream_events,
)


def anthropic_routes(handler: CompletionHandler) -> list[Route]:
    """/v1/messages and /v1/messages/count_tokens, served by `handler` (the OpenAI chat path)."""
    engine = handler.engine
    counting = Slots(engine.config.server.max_concurrent_counts, "token counts", "server.max_concurrent_counts")

    def count_text(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    async def parse(request: Request, count_only: bool = False) -> tuple[dict[str, Any], oa.CompletionRequest]:
        body = await read_json(request, engine.config.server.max_body_bytes)
        req = oa.parse_request(to_openai(body, count_only), "chat", handler.defaults)
        if not count_only:  # before the tokenizer renders any of it (context_management, cache_control cuts)
            await handler.check_size(req)
        if measures_prompt(body.get("context_management")):  # tool-use clearing: thresholds on the prompt's size
            size = PromptSize(len(await handler.tokens(req)), count_text)
            cleared = await run_in_threadpool(to_openai, body, count_only, size)
            req = oa.parse_request(cleared, "chat", handler.defaults)
        return body, req

    def failed(request: Request, exc: KVServeError) -> Response:
        note_error(request.scope, exc)
        response = error_response(exc)
        if exc.status_code in (429, 503):  # as the gate's: a client's retry waits a second
            response.headers["retry-after"] = "1"
        return response

    def cut_prompt(cut: dict[str, Any]) -> tuple[list[dict[str, Any]], list | None, dict[str, Any]]:
        """A cache_control cut's messages, tools and template kwargs, rendered as the request's own prompt
        is; not parsed as a request (its tool_choice may name a tool past the cut)."""
        out = to_openai(cut, count_only=True)
        return parse_messages(out["messages"]), out.get("tools") or None, out.get("chat_template_kwargs", {})

    async def cut_text(cut: dict[str, Any]) -> str | None:
        messages, offered, kwargs = cut_prompt(cut)
        return await prompts.chat_text(engine, messages, offered, kwargs)

    async def cut_tokens(cut: dict[str, Any]) -> list[int]:
        messages, offered, kwargs = cut_prompt(cut)
        return await prompts.chat_tokens(engine, messages, True, offered, kwargs)

    async def marked_ends(req: oa.CompletionRequest, found: list, prompt: list[int]) -> list[int]:
        """Where each marked prefix ends among `prompt`'s tokens (cache_control.marked_ends)."""
        offered = req.tools.tools if req.tools else None
        text = None if req.images else await prompts.chat_text(engine, req.messages or [], offered, req.template_kwargs)
        return await cache_control.marked_ends(handler, found, prompt, text, cache_control.Cut(cut_text, cut_tokens))

    async def messages(request: Request) -> Response:
        try:
            body, req = await parse(request)
            found, ends = cache_control.marks(body), None
            if found and engine.keeps_checkpoints:  # hybrid and sliding-window models keep a state where
                ends = await marked_ends(req, found, await handler.tokens(req))  # each marked prefix ends
                req = dataclasses.replace(req, checkpoint_at=tuple(end for end in ends if end))
            thinking = thinking_wanted(body)

            async def lease(gen_req: GenerationRequest) -> int:
                """The markers' prefixes pinned: the longest one's length (0 for none)."""
                if not found:
                    return 0
                prompt = gen_req.prompt_tokens
                marked = ends if ends is not None else await marked_ends(req, found, prompt)
                leased = await cache_control.apply(handler, found, marked, prompt, gen_req.block_hashes or ())
                return max(leased, default=0)

            async def pin(gen_req: GenerationRequest) -> cache_control.PendingLeases:
                pending = cache_control.PendingLeases(lambda: lease(gen_req))
                if not req.stream:  # beside the whole reply; a stream's after its first event
                    pending.start()
                return pending

            def events(gen_req: GenerationRequest, track: EventTracker, leases: Any) -> AsyncIterator[str]:
                return stream_events(handler, req, gen_req, track, leases, thinking)

            done = await handler.complete(request, req, events, pin)
        except KVServeError as exc:
            return failed(request, exc)
        if isinstance(done, Response):  # streamed, or the client left
            return done
        gen_req, text, ev, pending = done
        leased = await pending.leased()
        out = handler.output(req, gen_req)
        segments = [seg for seg in out.feed(text) + out.finish() if thinking or seg.kind != REASONING]
        stop = matched_stop(engine.tokenizer, req, text, ev)
        reason = stop_reason(ev.finish_reason, out.num_calls, stop)
        body = message_body(
            new_message_id(), engine.model_name, content_blocks(segments), reason, stop, ev.usage, leased
        )
        return JSONResponse(body)

    async def count_tokens(request: Request) -> Response:
        try:
            with counting.hold():  # to the thread's end: a tokenizer thread is not cancelled with its request
                _, req = await parse(request, count_only=True)
                handler.check_model(req.model)
                return JSONResponse({"input_tokens": len(await handler.tokens(req))})
        except KVServeError as exc:
            return failed(request, exc)

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
