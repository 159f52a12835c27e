"""Keeping each backend's state current: its health (polled) and its blocks (followed as events).

A backend whose /health fails (or that fails a proxied request) is out of rotation until a poll succeeds
again. The block follower reads the backend's layout, then its event stream from the last position it saw;
the backend answers with a snapshot first whenever that position means nothing to it (first contact, a
restarted backend, a position its bounded log has dropped), so a reconnect never leaves a stale block set.
Everything a backend sends is checked first (reports.py): an unusable report takes that backend out, never
the follower or the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from .backends import BackendState
from .models import parse_health_models
from .reports import (
    MAX_LAYOUT_BYTES,
    MAX_MESSAGE_BYTES,
    BadReportError,
    Events,
    Layout,
    Snapshot,
    parse_layout,
    parse_message,
)
from .sse import EventSplitter, fields

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed event stream the follower waits this long, doubling per failure in a row,
MAX_RETRY_S = 30.0  # up to this
# One event stream's life: short, since an open stream holds up the backend's graceful shutdown; the
# follower reconnects from its position at once and misses nothing.
STREAM_S = 5.0
# The longest silence an event stream may keep: the server sends a `: ping` every 2 s while idle.
STREAM_READ_TIMEOUT_S = 15.0
DOWN_AFTER_POLLS = 2  # failed health polls in a row that take a backend out (a refused connection: one)
MAX_HEALTH_BYTES = 4 * 1024 * 1024  # a /health body read for its models (every model's stats: a few KiB each)


async def iter_sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, bytes]]:
    """(event name, data) for each server-sent event with data (heartbeats are comments: skipped). Raises
    BadReportError for an event over MAX_MESSAGE_BYTES."""
    splitter = EventSplitter(MAX_MESSAGE_BYTES)
    async for chunk in chunks:
        events = splitter.feed(chunk)
        if None in events or splitter.is_over_bound:  # not waiting for the end of an endless one
            raise BadReportError(f"events: a message over {MAX_MESSAGE_BYTES} bytes")
        for event in events:
            name, data = fields(event)
            if data:
                yield name, data


def _json(resp: httpx.Response) -> Any:
    """The body as JSON (None when it is not, or is over MAX_HEALTH_BYTES)."""
    if len(resp.content) > MAX_HEALTH_BYTES:
        return None
    try:
        return json.loads(resp.content)
    except (ValueError, RecursionError):
        return None


class BackendFollower:
    """The two loops for one backend. `headers` authenticate to it; `on_layout(model, model_path)` is
    called with what each layout names (the router loads a tokenizer from the first); `on_resync()` counts
    snapshots.

    Neither loop ends before it is cancelled, whatever the backend sends. A report the router cannot use
    (reports.BadReportError) takes the backend out of rotation, logged once with its reason, and the
    follower tries again with a growing pause; the first sound snapshot puts the backend back."""

    def __init__(
        self,
        state: BackendState,
        client: httpx.AsyncClient,
        headers: dict[str, str],
        health_interval_s: float,
        on_layout: Callable[[str, str], None] = lambda model, path: None,
        on_resync: Callable[[], None] = lambda: None,
        connect_timeout_s: float = 5.0,
    ):
        self.state = state
        self.client = client
        self.headers = headers
        self.health_interval_s = health_interval_s
        self.on_layout = on_layout
        self.on_resync = on_resync
        self.connect_timeout_s = connect_timeout_s
        self.epoch: str | None = None  # the backend's event log this follower has followed
        self.seq: int | None = None  # the last event applied (None: a snapshot is needed)
        self.is_following = False
        self.failed_polls = 0  # consecutive failed health polls
        self.stream_error = ""  # why the last event stream failed, as logged ("" once one worked)

    @property
    def poll_timeout_s(self) -> float:
        # a busy machine can stall a server's event loop for a moment
        return max(5.0, 2 * self.health_interval_s)

    async def run_health(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # a bug here must not end the polls: the backend would never come back
                log.exception("health poll of %s failed", self.state.url)
            await asyncio.sleep(self.health_interval_s)

    async def check_health(self) -> bool:
        """One poll. A refused connection takes the backend out at once; a slow or failed answer only on the
        second poll in a row (a busy machine can stall a server's event loop for a moment)."""
        refused = False
        try:
            resp = await self.client.get(self.state.url + "/health", timeout=self.poll_timeout_s)
            ok, reason = resp.status_code == 200, f"/health answered {resp.status_code}"
            if ok:  # which models it serves, and which are loaded (models.py)
                self.state.set_models(parse_health_models(_json(resp)))
        except httpx.HTTPError as exc:
            ok, reason, refused = False, f"/health failed: {type(exc).__name__}", isinstance(exc, httpx.ConnectError)
        self.failed_polls = 0 if ok else self.failed_polls + 1
        if ok and not self.state.is_reachable:
            log.info("backend %s is back", self.state.url)
            self.state.mark_up()
        elif not ok and (refused or self.failed_polls >= DOWN_AFTER_POLLS) and self.state.last_error != reason:
            log.warning("backend %s is out of rotation: %s", self.state.url, reason)
            self.state.mark_down(reason)
        return ok

    async def run_events(self) -> None:
        failures = 0  # in a row: the pause before the next try doubles with each
        while True:
            try:
                await self.follow_once()
                failures = 0
                continue
            except BadReportError as exc:
                self._bad_report(str(exc))
            except httpx.HTTPError as exc:
                self._stream_failed(f"{type(exc).__name__}: {exc}", logging.INFO)
            except Exception as exc:  # a bug here must not end the follower for good
                self._stream_failed(f"{type(exc).__name__}: {exc}", logging.ERROR, exc_info=True)
            finally:
                self.is_following = False
            failures += 1
            await asyncio.sleep(min(RETRY_S * 2 ** min(failures - 1, 16), MAX_RETRY_S))

    def _bad_report(self, reason: str) -> None:
        """Out of rotation, the position forgotten: a fresh snapshot must prove the backend sound again."""
        self.epoch = self.seq = None
        if self.state.report_error != reason:
            log.warning("backend %s is out of rotation: it reported an unusable %s", self.state.url, reason)
        self.state.mark_bad_report(reason)
        self.stream_error = reason

    def _stream_failed(self, reason: str, level: int, exc_info: bool = False) -> None:
        if level >= logging.ERROR:
            self.epoch = self.seq = None  # not knowing what went wrong, trust no part of the block set
        if reason != self.stream_error:
            log.log(level, "block events of %s stopped: %s; retrying", self.state.url, reason, exc_info=exc_info)
        self.stream_error = reason

    def _following(self) -> None:
        self.is_following = True
        if self.stream_error:
            log.info("block events of %s: following again", self.state.url)
            self.stream_error = ""

    def _sound(self) -> None:
        """What the backend reports is usable again."""
        if self.state.report_error:
            log.info("backend %s reports sound data again: back in rotation", self.state.url)
            self.state.mark_sound_report()

    async def _layout(self) -> Layout:
        url = self.state.url + "/v1/cache/layout"
        async with self.client.stream("GET", url, headers=self.headers, timeout=self.poll_timeout_s) as resp:
            resp.raise_for_status()
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_LAYOUT_BYTES:
                    break
        return parse_layout(bytes(body))

    async def follow_once(self) -> None:
        """Read the layout, then one event stream to its end. Raises httpx.HTTPError, BadReportError."""
        url = self.state.url
        layout = await self._layout()
        self.on_layout(layout.model, layout.model_path)
        self.state.set_layout(layout.namespace, layout.block_size)
        if not layout.enabled:  # no block cache there: route it by load alone
            self.stream_error = ""
            self._sound()
            await asyncio.sleep(self.health_interval_s * 5)
            return
        params: dict[str, Any] = {"max_s": STREAM_S}
        if self.seq is not None and self.epoch == layout.epoch:
            params.update(since=self.seq, epoch=self.epoch)
        timeout = httpx.Timeout(self.connect_timeout_s, read=STREAM_READ_TIMEOUT_S)
        events_url = url + "/v1/cache/events"
        async with self.client.stream("GET", events_url, params=params, headers=self.headers, timeout=timeout) as resp:
            resp.raise_for_status()
            self._following()
            async for name, data in iter_sse(resp.aiter_bytes()):
                if name == "end":
                    return
                self.apply(parse_message(name, data))

    def apply(self, message: Snapshot | Events | None) -> None:
        """One checked message. Events need a position (a snapshot first): without one the block set would
        be a guess, so they are refused as a bad report."""
        if isinstance(message, Snapshot):
            self.state.reset_blocks(message.hashes)
            self.on_resync()
        elif isinstance(message, Events):
            if self.seq is None:
                raise BadReportError("events: sent before any snapshot")
            self.state.apply_ordered(message.events)
        else:
            return
        self.epoch, self.seq = message.epoch, message.seq
        self._sound()
