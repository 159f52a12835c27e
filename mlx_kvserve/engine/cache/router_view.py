"""What a router follows of this server's cache: the namespace, and which block hashes RAM holds
as a snapshot plus the events after it (engine side of GET /v1/cache/router/*)."""

from __future__ import annotations

from typing import Any

from ...kv.events import BlockEventLog
from ...kv.manager import KVManager

PAGE = 5_000  # events per message


class RouterView:
    """A router's window on one KVManager: `layout()` and `next_messages(since, epoch)`."""

    def __init__(self, manager: KVManager):
        self._manager = manager

    @property
    def epoch(self) -> str:
        return self._manager.events.epoch

    def layout(self) -> dict[str, Any]:
        """The namespace and block size a router hashes prompts with, and the event log's position."""
        manager, log = self._manager, self._manager.events
        return {
            "namespace": manager.hasher.namespace.hex(),
            "block_size": manager.block_size,
            "epoch": log.epoch,
            "last_seq": log.last_seq,
        }

    def next_messages(self, since: int | None, epoch: str | None) -> tuple[list[dict[str, Any]], int]:
        """The messages a follower at (`since`, `epoch`) needs now, and its position after them."""
        return _next_messages(self._manager, since, epoch)


def _snapshot_message(manager: KVManager) -> dict[str, Any]:
    """Every hash in RAM, current from `seq`: the number is read before the hashes, so replaying the events
    after it on top of the snapshot (set operations, in order) gives the state at any later point."""
    log = manager.events
    seq = log.last_seq
    hashes = [b.block_hash.hex() for b in manager.resident_blocks()]
    return {"type": "snapshot", "epoch": log.epoch, "seq": seq, "hashes": hashes}


def _events_message(log: BlockEventLog, events) -> dict[str, Any]:
    return {
        "type": "events",
        "epoch": log.epoch,
        "seq": events[-1].seq,
        "events": [[e.kind.value, e.block_hash.hex()] for e in events],
    }


def _next_messages(manager: KVManager, since: int | None, epoch: str | None) -> tuple[list[dict[str, Any]], int]:
    """The messages a follower at (`since`, `epoch`) needs now, and its position after them."""
    log = manager.events
    if since is None or epoch != log.epoch:
        snap = _snapshot_message(manager)
        return [snap], snap["seq"]
    page = log.since(since, PAGE)
    if page.resync:
        snap = _snapshot_message(manager)
        return [snap], snap["seq"]
    if not page.events:
        return [], since
    return [_events_message(log, page.events)], page.events[-1].seq
