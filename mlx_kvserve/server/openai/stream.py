"""OpenAI's streamed replies (chat and text completions): each choice's chunks, from its role
chunk to its finish reason, merged as they come when the request has several choices
(server/openai/choices.py), then the usage chunk and [DONE]."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ...engine.request import Finished, GenerationRequest, TextDelta
from ...errors import KVServeError, RequestTimeoutError
from ...formats.output import REASONING, TOOL, ChatOutput, Segment
from .. import sse
from ..completion import CompletionHandler, as_kvserve_error
from ..deadlines import EventTracker
from . import choices
from . import parse as oa
from . import reply as oar
from .progress import Progress, PromptProgress, progress_reader


async def stream_reply(
    handler: CompletionHandler, req: oa.CompletionRequest, submitted: list[tuple[GenerationRequest, EventTracker]]
) -> AsyncIterator[str]:
    """The streamed reply: every choice's chunks as they come (each with its index), then the
    usage chunk when asked for, then [DONE]. A choice that fails ends the stream with its error."""
    rid, model = submitted[0][0].request_id, handler.engine.model_name
    finished: dict[int, Finished] = {}  # by choice index
    failed: list[KVServeError] = []
    streams = [
        _choice_stream(handler, req, rid, i, gen_req, track, finished, failed)
        for i, (gen_req, track) in enumerate(submitted)
    ]
    try:
        async with contextlib.aclosing(choices.merged(streams)) as items:
            async for item in items:
                yield item
                if failed:
                    break
        if not failed and len(finished) == len(submitted):
            usage = choices.combined_usage([finished[i].usage for i in range(len(submitted))])
            submitted[0][1].record_usage(usage)
            if req.include_usage:
                yield sse.data(oar.usage_chunk(req, rid, model, usage))
        yield "data: [DONE]\n\n"
    finally:
        for gen_req, _ in submitted:
            gen_req.cancel()  # the client went away or the stream ended: free the worker


async def _choice_stream(
    handler: CompletionHandler,
    req: oa.CompletionRequest,
    rid: str,
    index: int,
    gen_req: GenerationRequest,
    track: EventTracker,
    finished: dict[int, Finished],
    failed: list[KVServeError],
) -> AsyncIterator[str]:
    """One choice's chunks, from its role chunk to its finish reason; its Finished event is
    put in `finished` at its index, or the error that ended it to `failed` after its error chunk."""
    model = handler.engine.model_name
    out = handler.output(req, gen_req) if req.kind == "chat" else None
    formatter = handler.logprob_formatter(req) if req.logprobs.enabled else None
    progress = PromptProgress(progress_reader(handler.engine, gen_req)) if req.return_progress else None

    def data(chunk: dict) -> str:
        chunk["choices"][0]["index"] = index
        return sse.data(chunk)

    try:
        yield data(oar.chunk_body(req, rid, model, "" if req.kind == "chat" else None, None, first=True))
        while True:
            try:
                if progress is not None and not track.got_first:
                    ev = await progress.next(track)
                else:
                    ev = await sse.next_or_keep_alive(track)
            except RequestTimeoutError as exc:  # the status is sent: end the stream with the error
                failed.append(exc)
                yield sse.data(oar.error_body(exc.message, exc.error_type, exc.param, exc.code))
                return
            if ev is sse.KEEP_ALIVE:  # a long prefill: bytes on the wire so the client waits
                yield sse.COMMENT_KEEP_ALIVE
            elif isinstance(ev, Progress):  # return_progress: an empty delta carrying the prefill's progress
                yield data({**oar.chunk_body(req, rid, model, None, None), "prompt_progress": ev.payload})
            elif isinstance(ev, TextDelta):
                if ev.text and out is None:
                    chunks = [oar.chunk_body(req, rid, model, ev.text, None)]
                else:
                    chunks = _segment_chunks(req, rid, model, out, out.feed(ev.text)) if ev.text else []
                if formatter is not None and ev.logprobs:  # on the tokens' first chunk, or one of its own
                    chunks = chunks or [oar.chunk_body(req, rid, model, None if out else "", None)]
                    chunks[0]["choices"][0]["logprobs"] = formatter.block(ev.logprobs)
                for chunk in chunks:
                    yield data(chunk)
            elif isinstance(ev, Finished):
                track.finished(ev)
                reason = ev.finish_reason
                if out is not None:
                    for chunk in _segment_chunks(req, rid, model, out, out.finish()):
                        yield data(chunk)
                    reason = "tool_calls" if out.num_calls and reason == "stop" else reason
                finished[index] = ev
                yield data(handler.with_extension(oar.chunk_body(req, rid, model, None, reason), req, gen_req))
                return
            else:
                err = as_kvserve_error(ev.error)
                track.failed(err)
                failed.append(err)
                yield sse.data(oar.error_body(err.message, err.error_type, err.param, err.code))
                return
    finally:
        gen_req.cancel()  # the client went away or the stream ended: free the worker


def _segment_chunks(req, rid: str, model: str, out: ChatOutput, segments: list[Segment]) -> list[dict]:
    """Chunks for segments of a streamed chat reply; tool calls are numbered across the reply."""
    chunks, index = [], out.num_calls - sum(len(s.calls) for s in segments)
    for seg in segments:
        if seg.kind == TOOL:
            deltas = [call.openai(index + i) for i, call in enumerate(seg.calls)]
            index += len(seg.calls)
            chunks.append(oar.chunk_body(req, rid, model, None, None, tool_calls=deltas))
        elif seg.kind == REASONING:
            chunks.append(oar.chunk_body(req, rid, model, None, None, reasoning=seg.text))
        else:
            chunks.append(oar.chunk_body(req, rid, model, seg.text, None))
    return chunks
