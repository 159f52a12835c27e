"""Keeping each backend's state current: its health (polled) and its blocks (followed as events).

A backend whose /health fails (or that fails a proxied request) is out of rotation until a poll succeeds
again. The block follower reads the backend's layout, then its event stream from the last position it saw;
the backend answers with a snapshot first whenever that position means nothing to it (first contact, a
restarted backend, a position its bounded log has dropped), so a reconnect never leaves a stale block set.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from .backends import BackendState

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed event stream, the follower waits this long before it reconnects
# One event stream's life: short, since an open stream holds up the backend's graceful shutdown; the
# follower reconnects from its position at once and misses nothing.
STREAM_S = 5.0
DOWN_AFTER_POLLS = 2  # failed health polls in a row that take a backend out (a refused connection: one)


async def iter_sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) for each server-sent event; comment lines (heartbeats) are skipped."""
    name, data = "message", []
    async for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


class BackendFollower:
    """The two loops for one backend. `headers` authenticate to it; `on_layout(model, model_path)` is
    called with what each layout names (the router loads a tokenizer from the first); `on_resync()` counts
    snapshots."""

    def __init__(
        self,
        state: BackendState,
        client: httpx.AsyncClient,
        headers: dict[str, str],
        health_interval_s: float,
        on_layout: Callable[[str, str], None] = lambda model, path: None,
        on_resync: Callable[[], None] = lambda: None,
    ):
        self.state = state
        self.client = client
        self.headers = headers
        self.health_interval_s = health_interval_s
        self.on_layout = on_layout
        self.on_resync = on_resync
        self.epoch: str | None = None  # the backend's event log this follower has followed
        self.seq: int | None = None  # the last event applied (None: a snapshot is needed)
        self.is_following = False
        self.failed_polls = 0  # consecutive failed health polls

    async def run_health(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    async def check_health(self) -> bool:
        """One poll. A refused connection takes the backend out at once; a slow or failed answer only on the
        second poll in a row (a busy machine can stall a server's event loop for a moment)."""
        refused = False
        try:
            resp = await self.client.get(self.state.url + "/health", timeout=max(5.0, 2 * self.health_interval_s))
            ok, reason = resp.status_code == 200, f"/health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, reason, refused = False, f"/health failed: {type(exc).__name__}", isinstance(exc, httpx.ConnectError)
        self.failed_polls = 0 if ok else self.failed_polls + 1
        if ok and not self.state.is_up:
            log.info("backend %s is back", self.state.url)
            self.state.mark_up()
        elif not ok and (refused or self.failed_polls >= DOWN_AFTER_POLLS) and self.state.last_error != reason:
            log.warning("backend %s is out of rotation: %s", self.state.url, reason)
            self.state.mark_down(reason)
        return ok

    async def run_events(self) -> None:
        while True:
            try:
                await self.follow_once()
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                log.debug("block events of %s: %s", self.state.url, exc)
                await asyncio.sleep(RETRY_S)
            finally:
                self.is_following = False

    async def follow_once(self) -> None:
        """Read the layout, then one event stream to its end. Raises httpx.HTTPError, ValueError."""
        url = self.state.url
        resp = await self.client.get(url + "/v1/cache/layout", headers=self.headers)
        resp.raise_for_status()
        layout = resp.json()
        self.on_layout(str(layout.get("model", "")), str(layout.get("model_path", "")))
        if not layout.get("enabled"):
            self.state.set_layout(None, 0)  # no block cache there: route it by load alone
            await asyncio.sleep(self.health_interval_s * 5)
            return
        self.state.set_layout(bytes.fromhex(layout["namespace"]), int(layout["block_size"]))
        params: dict[str, Any] = {"max_s": STREAM_S}
        if self.seq is not None and self.epoch == layout["epoch"]:
            params.update(since=self.seq, epoch=self.epoch)
        async with self.client.stream("GET", url + "/v1/cache/events", params=params, headers=self.headers) as resp:
            resp.raise_for_status()
            self.is_following = True
            async for name, data in iter_sse(resp.aiter_lines()):
                if name == "end":
                    return
                self.apply(name, json.loads(data))

    def apply(self, name: str, message: dict[str, Any]) -> None:
        if name == "snapshot":
            self.state.reset_blocks(bytes.fromhex(h) for h in message["hashes"])
            self.on_resync()
        elif name == "events":
            self.state.apply_ordered((kind == "stored", bytes.fromhex(h)) for kind, h in message["events"])
        else:
            return
        self.epoch, self.seq = message["epoch"], int(message["seq"])
