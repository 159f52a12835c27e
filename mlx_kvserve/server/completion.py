"""The one completion path every API uses (OpenAI chat and text completions, Anthropic Messages,
Responses): a parsed request checked, tokenized and submitted to the engine, then its events streamed or
collected, the generation cancelled when the client leaves or anything fails after the submission.

Each API parses its body into a CompletionRequest (server/openai/parse.py) and shapes the reply itself
(server/openai/, anthropic/, responses/); the engine sees one kind of request from all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..engine.front import EngineFront
from ..engine.request import Event, Finished, GenerationRequest, TextDelta, TokenLogprob
from ..engine.sampling.tool_grammar import CallGrammar, UnsupportedCallFormat
from ..errors import InvalidRequestError, KVServeError, ValidationError, model_not_found
from ..formats.output import ChatOutput
from ..formats.tool_calls import check_support
from ..vision.runtime import VisionPrompt
from . import context_window as cw
from . import prompt_bound, prompts, sse
from .deadlines import Deadlines, EventTracker
from .gate import PRINCIPAL_KEY, RECORD_KEY
from .messages import IMAGE_MARK
from .metrics import RequestRecord
from .openai import parse as oa
from .openai import reply as oar
from .openai import tools as tl
from .openai.logprobs import LogprobFormatter

_DISCONNECT_POLL_S = 0.2


class Completed(NamedTuple):
    """A whole reply of CompletionHandler.complete: its generation, text and Finished event, and what
    the `prepare` step returned."""

    gen_req: GenerationRequest
    text: str
    finished: Finished
    prepared: Any


class CompletionHandler:
    """Turns one parsed request into GenerationRequests and their events into text; every API's routes
    serve their completions through one handler."""

    def __init__(self, engine: EngineFront):
        self.engine = engine
        gen = engine.config.generation
        self.defaults = oa.Defaults(gen.max_tokens, gen.temperature, gen.top_p)
        self.cached_block = 0  # > 0: cached_tokens reported in whole blocks of this size ([cache] report_cached)

    def reported(self, ev: Event) -> Event:
        """`ev` as the client sees it: a Finished event's cached_tokens rounded down to whole blocks
        when `cached_block` is set (and so in the request log and metrics, which read the same event)."""
        if not self.cached_block or not isinstance(ev, Finished):
            return ev
        cached = ev.usage.cached_tokens - ev.usage.cached_tokens % self.cached_block
        return dataclasses.replace(ev, usage=dataclasses.replace(ev.usage, cached_tokens=cached))

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", "default", self.engine.model_name):
            raise model_not_found(name, [self.engine.model_name])

    async def tokens(self, req: oa.CompletionRequest) -> list[int]:
        """The prompt's token ids (with each image's placeholder tokens, for a request with images)."""
        prompt, _ = await self.prompt(req)
        return prompt

    async def prompt(self, req: oa.CompletionRequest) -> tuple[list[int], VisionPrompt | None]:
        """The prompt's token ids, and for a request with images its VisionPrompt (the ids the cache
        keys it by and the images' spans). 4xx for images a text model or the limits refuse."""
        if req.images:
            vision = await self.vision_prompt(req)
            return vision.tokens, vision
        return await self._text_prompt(req), None

    async def fitted_prompt(
        self, request: Request, req: oa.CompletionRequest
    ) -> tuple[oa.CompletionRequest, tuple[list[int], VisionPrompt | None]]:
        """`req` and its prompt, held to the context window before any work starts: a prompt past it
        raises ContextLengthError, or with [server] context_overflow = "truncate" a chat request without
        images drops whole older turns (the request returned is then the one that fits; the count of
        messages dropped is noted for the response header and logged)."""
        server = self.engine.config.server
        win = cw.window(self.engine.context_length, server.max_prompt_tokens)
        await self.check_size(req)
        prompt, vision = await self.prompt(req)
        if len(prompt) <= win.max_prompt:
            return req, (prompt, vision)
        if server.context_overflow != "truncate" or req.kind != "chat" or req.images:
            raise cw.ContextLengthError(len(prompt), win, req.kind)
        offered = req.tools.tools if req.tools else None

        async def render(messages: list[dict[str, Any]]) -> list[int]:
            return await prompts.chat_tokens(self.engine, messages, True, offered, req.template_kwargs)

        fitted = await cw.fit_turns(req.messages or [], render, win.max_prompt)
        if fitted is None:  # even the newest user turn is past the window
            raise cw.ContextLengthError(len(prompt), win, req.kind)
        request.scope[cw.TRUNCATED_KEY] = fitted.num_dropped
        cw.log.info(
            "context_overflow=truncate: dropped %d of %d messages (%d -> %d prompt tokens; window %d)",
            fitted.num_dropped, len(req.messages or []), len(prompt), len(fitted.tokens), win.told,
        )  # fmt: skip
        return dataclasses.replace(req, messages=fitted.messages), (fitted.tokens, None)

    async def check_size(self, req: oa.CompletionRequest) -> None:
        """ContextLengthError for a prompt whose text alone is past the window, before the tokenizer
        runs on it (prompt_bound.py); nothing for one that might fit."""
        server = self.engine.config.server
        win = cw.window(self.engine.context_length, server.max_prompt_tokens)
        truncate = server.context_overflow == "truncate" and req.kind == "chat" and not req.images
        await run_in_threadpool(prompt_bound.check_size, req, self.engine.tokenizer, win, truncate)

    async def vision_prompt(self, req: oa.CompletionRequest) -> VisionPrompt:
        vision = self.engine.vision
        if vision is None:
            raise InvalidRequestError(
                f"model {self.engine.model_name!r} takes no images (a text model, or a vision family not served: "
                "docs/vision.md)",
                param="messages",
            )
        images = await run_in_threadpool(vision.images, req.images)  # decoded, bounded, hashed
        marked = [{**m, "content": m["content"].replace(IMAGE_MARK, vision.marker)} for m in req.messages or []]
        rendered = await self._text_prompt(dataclasses.replace(req, messages=marked, images=()))
        return vision.build(rendered, images)

    async def _text_prompt(self, req: oa.CompletionRequest) -> list[int]:
        if req.kind == "chat":
            check_support(self.engine.tokenizer, req.tools)
            offered = req.tools.tools if req.tools else None
            return await prompts.chat_tokens(self.engine, req.messages, True, offered, req.template_kwargs)
        if isinstance(req.prompt, list):
            prompts.check_token_ids(self.engine, req.prompt)
            return req.prompt
        return await prompts.text_tokens(self.engine, req.prompt)

    def logprob_formatter(self, req: oa.CompletionRequest) -> LogprobFormatter:
        return LogprobFormatter(self.engine.tokenizer, req.kind)

    def output(self, req: oa.CompletionRequest, gen_req: GenerationRequest) -> ChatOutput:
        """The splitter of this chat reply into reasoning, content and tool calls."""
        return ChatOutput(self.engine.tokenizer, gen_req.prompt_tokens, req.tools)

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
        prefills the prompt, the others wait for its blocks (server/openai/choices.py). Each has its own
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
        calls = tl.call_grammar(req.tools, req.json_schema)
        if req.json_schema is not None and calls is None:
            await self.check_schema(req.json_schema)
        req, (prompt, vision) = await self.fitted_prompt(request, req)  # refused here past the context
        keys = vision.cache_tokens if vision is not None else prompt  # what the block cache keys it by
        grammar = await self.call_grammar(prompt, calls) if calls is not None else None
        principal = request.scope.get(PRINCIPAL_KEY, "")  # per_key isolation: the key's own cache namespace
        hashes = self.engine.block_hashes(keys, principal)  # once, for every stage of every choice
        await self.touch_leases(keys, hashes)
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
                    checkpoint_at=req.checkpoint_at,
                    block_hashes=hashes,
                    emit=lambda ev, events=events: loop.call_soon_threadsafe(events.put_nowait, self.reported(ev)),
                    images=vision.images if vision is not None else (),
                    cache_tokens=vision.cache_tokens if vision is not None else None,
                    principal=principal,
                )
                self.engine.submit(gen_req)
                submitted.append((gen_req, EventTracker(events, deadlines, record)))
        except BaseException:
            for gen_req, _ in submitted:  # a later choice was refused (queue full): the others go too
                gen_req.cancel()
            raise
        record.request_id, record.prompt_tokens = rid, len(prompt)
        return submitted

    async def complete(
        self,
        request: Request,
        req: oa.CompletionRequest,
        stream: Callable[[GenerationRequest, EventTracker, Any], AsyncIterator[str]],
        prepare: Callable[[GenerationRequest], Awaitable[Any]] | None = None,
    ) -> Completed | Response:
        """One completion of `req` (its `n` is not read: for the APIs with one reply): submitted, then
        `prepare(gen_req)` (the steps that may still refuse the request, such as leases), then streamed
        as the events of `stream(gen_req, track, prepared)` or collected whole. Returns the streamed
        response, a 499 response when the client left, or the Completed reply for the caller to shape.
        Raises what submit, prepare and collect raise; anything raised after the submission cancels the
        generation first, so no reply runs on for a request that was answered with an error."""
        gen_req, track = await self.submit(request, req)
        try:
            prepared = await prepare(gen_req) if prepare is not None else None
            if req.stream:
                return sse.GenerationStream(stream(gen_req, track, prepared), gen_req)
            done = await self.collect(request, gen_req, track)
        except BaseException:
            gen_req.cancel()
            raise
        if isinstance(done, Response):  # the client left
            return done
        text, ev = done
        return Completed(gen_req, text, ev, prepared)

    async def touch_leases(self, prompt: list[int], hashes: list[bytes]) -> None:
        """cache_control pins this prompt uses live their TTL again (a no-op without leases)."""
        if self.engine.leases_active:
            await run_in_threadpool(self.engine.cache_admin().touch_leases, prompt, hashes)

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
            hashes = (
                gen_req.block_hashes
                if gen_req.block_hashes is not None
                else self.engine.block_hashes(gen_req.prompt_tokens, gen_req.principal)
            )
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


def as_kvserve_error(exc: Exception) -> KVServeError:
    """`exc` as the error the client gets: a KVServeError as it is, anything else a 500."""
    if isinstance(exc, KVServeError):
        return exc
    return KVServeError(f"generation failed: {type(exc).__name__}: {exc}")
