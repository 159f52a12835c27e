"""The OpenAI completion routes: `POST /v1/chat/completions` and `/v1/completions`, whole or streamed,
with `n` choices (server/openai/choices.py), served by the one CompletionHandler."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine.request import Finished, GenerationRequest, TokenLogprob
from ...formats.output import collect as collect_segments
from .. import sse
from ..bodies import read_json
from ..completion import CompletionHandler
from . import choices
from . import parse as oa
from . import reply as oar
from .stream import stream_reply


def openai_routes(handler: CompletionHandler) -> list[Route]:
    """/v1/chat/completions and /v1/completions, served by `handler`."""

    async def chat(request: Request) -> Response:
        return await complete(handler, request, "chat")

    async def completions(request: Request) -> Response:
        return await complete(handler, request, "text")

    return [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


async def complete(handler: CompletionHandler, request: Request, kind: str) -> Response:
    """One OpenAI completion request (`kind`: "chat" or "text"): its `n` choices, whole or streamed."""
    body = await read_json(request, handler.engine.config.server.max_body_bytes)
    req = oa.parse_request(body, kind, handler.defaults)
    submitted = await handler.submit_choices(request, req)
    gen_reqs = [gen_req for gen_req, _ in submitted]
    if req.stream:
        return sse.GenerationStream(stream_reply(handler, req, submitted), *gen_reqs)
    entries: list[list[TokenLogprob]] = [[] for _ in submitted]
    waits = [handler.collect(request, g, track, e) for (g, track), e in zip(submitted, entries, strict=True)]
    done = await choices.gather(waits, gen_reqs)
    if gone := next((d for d in done if isinstance(d, Response)), None):
        return gone  # the client left
    bodies = []
    for gen_req, (text, ev), logprobs in zip(gen_reqs, done, entries, strict=True):
        body = _reply_body(handler, req, gen_req, text, ev)
        if req.logprobs.enabled:
            body["choices"][0]["logprobs"] = handler.logprob_formatter(req).block(logprobs)
        bodies.append(body)
    usage = choices.combined_usage([ev.usage for _, ev in done])
    submitted[0][1].record_usage(usage)
    body = choices.merge_bodies(bodies, oar.usage_body(usage))
    return JSONResponse(handler.with_extension(body, req, gen_reqs[0]))


def _reply_body(
    handler: CompletionHandler, req: oa.CompletionRequest, gen_req: GenerationRequest, text: str, ev: Finished
) -> dict:
    rid, model = gen_req.request_id, handler.engine.model_name
    if req.kind != "chat":
        return oar.response_body(req, rid, model, text, ev.finish_reason, ev.usage)
    out = handler.output(req, gen_req)
    content, reasoning, calls = collect_segments(out.feed(text) + out.finish())
    return oar.response_body(req, rid, model, content, ev.finish_reason, ev.usage, reasoning, calls)
