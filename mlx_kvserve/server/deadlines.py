"""Per-request deadlines (server.first_token_timeout_s, server.request_timeout_s) and the event wait
that honours them. Both count from the request's arrival, so time spent waiting for the worker or
in prefill counts too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..engine.request import Event, Finished, TextDelta, Usage
from ..errors import KVServeError, RequestTimeoutError
from .metrics import RequestRecord


class Deadlines:
    """When a request must have its first token and its last (monotonic seconds; None = never)."""

    def __init__(
        self, started: float, first_token_s: float, total_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.first_token_at = started + first_token_s if first_token_s > 0 else None
        self.end_at = started + total_s if total_s > 0 else None
        self.first_token_s, self.total_s = first_token_s, total_s
        self.clock = clock

    def pending(self, got_first: bool) -> tuple[float, RequestTimeoutError] | None:
        """The earliest deadline still to meet and the error for missing it; None when none is left."""
        options = []
        if self.first_token_at is not None and not got_first:
            error = RequestTimeoutError(
                f"no token within server.first_token_timeout_s ({self.first_token_s:g}s); the request was cancelled",
                code="first_token_timeout",
            )
            options.append((self.first_token_at, error))
        if self.end_at is not None:
            error = RequestTimeoutError(
                f"the request ran past server.request_timeout_s ({self.total_s:g}s); it was cancelled",
                code="request_timeout",
            )
            options.append((self.end_at, error))
        return min(options, key=lambda option: option[0]) if options else None


async def next_event(
    events: asyncio.Queue[Event], deadlines: Deadlines, got_first: bool, poll_s: float | None = None
) -> Event | None:
    """The next event from the worker, or None once `poll_s` seconds passed without one. Raises
    RequestTimeoutError when a deadline passes first (the caller cancels the request)."""
    pending = deadlines.pending(got_first)
    wait = poll_s
    if pending is not None:
        left = max(0.0, pending[0] - deadlines.clock())
        wait = left if wait is None else min(wait, left)
    try:
        return await asyncio.wait_for(events.get(), wait)
    except asyncio.TimeoutError:
        if pending is not None and deadlines.clock() >= pending[0]:
            raise pending[1] from None
        return None


class EventTracker:
    """Follows one submitted request's events for the HTTP side: enforces its deadlines and fills
    in its RequestRecord (first token, usage, the error that ended it)."""

    def __init__(self, events: asyncio.Queue[Event], deadlines: Deadlines, record: RequestRecord):
        self.events = events
        self.deadlines = deadlines
        self.record = record
        self.got_first = False

    async def next(self, poll_s: float | None = None) -> Event | None:
        """As `next_event`; records the first event's arrival as the first token."""
        try:
            ev = await next_event(self.events, self.deadlines, self.got_first, poll_s)
        except RequestTimeoutError as exc:
            self.failed(exc)
            raise
        if ev is not None and not self.got_first:
            self.got_first = True
            self.record.mark_first_token()
        if isinstance(ev, TextDelta):  # counted as they come: a stream the client cuts still logs its tokens
            self.record.completion_tokens += ev.num_tokens
        return ev

    def finished(self, ev: Finished) -> None:
        self.record_usage(ev.usage)

    def record_usage(self, usage: Usage) -> None:
        """The request's token counts (several choices: their combined usage, server/openai/choices.py)."""
        self.record.prompt_tokens = usage.prompt_tokens
        self.record.cached_tokens = usage.cached_tokens
        self.record.completion_tokens = usage.completion_tokens

    def failed(self, error: KVServeError) -> None:
        self.record.error = error.code or error.error_type
