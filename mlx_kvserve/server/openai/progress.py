"""llama.cpp's `return_progress`: a streamed request that asks for it gets, while its prompt prefills,
chunks with an empty delta and a `prompt_progress` object ({total, cache, processed, time_ms}: the
prompt's tokens, those the cache supplied, those in the KV so far with the cached ones, ms since the
request started). Clients that do not know the field see an empty chunk and skip it.

The progress is polled from the engine (the same figures /health's batch.prefilling shows), not
sent through the worker's event queue: a stream that did not ask costs nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ...engine.front import EngineFront
from ...engine.request import Event
from .. import sse
from ..deadlines import EventTracker

POLL_S = 0.25  # how often a waiting stream reads its prompt's progress


class Progress(NamedTuple):
    """What PromptProgress.next returns when the prompt's prefill moved on."""

    payload: dict[str, int]


class PromptProgress:
    """One stream's wait for its first token, reporting the prefill's progress as it moves."""

    def __init__(self, read: Callable[[], dict[str, int] | None]):
        self.read = read  # the request's progress now, None when it is not prefilling
        self.processed = -1  # tokens processed in the last progress sent
        self.quiet_since = time.monotonic()  # when the stream last sent something

    async def next(self, track: EventTracker) -> Event | Progress | object:
        """The request's next event; a Progress when its prefill moved since the last one; KEEP_ALIVE
        after sse.KEEP_ALIVE_S with neither. Raises RequestTimeoutError as track.next does."""
        while True:
            ev = await track.next(POLL_S)
            if ev is not None:
                self.quiet_since = time.monotonic()
                return ev
            now = self.read()
            if now is not None and now["processed"] > self.processed:
                self.processed, self.quiet_since = now["processed"], time.monotonic()
                return Progress(now)
            if time.monotonic() - self.quiet_since >= sse.KEEP_ALIVE_S:
                self.quiet_since = time.monotonic()
                return sse.KEEP_ALIVE


def progress_reader(engine: EngineFront, gen_req: Any) -> Callable[[], dict[str, int] | None]:
    """Reads `gen_req`'s progress from `engine`; an engine without prefill progress (a model's own
    process behind a proxy) reads None, so the stream sends keep-alives only."""
    read = getattr(engine, "prompt_progress", None)
    return (lambda: read(gen_req)) if callable(read) else (lambda: None)
