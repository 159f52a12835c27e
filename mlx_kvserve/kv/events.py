"""A small bounded log of block events (stored / removed) for followers such as the router.

Each event gets a sequence number that only grows. A follower asks for everything after the last number it
saw; when that number has already fallen out of the bounded log (or belongs to an earlier process, i.e. is
ahead of the log), it gets `resync=True` and must rebuild its view from a snapshot of the stored hashes.
Each log also has a random `epoch`: numbers from another log (a restarted process) mean nothing here, and a
follower that names a different epoch must resync even when its number happens to be in range.
The log never blocks the caller beyond one short lock; the KV manager appends to it as blocks come and go.
"""

from __future__ import annotations

import enum
import threading
import uuid
from collections import deque
from typing import NamedTuple

DEFAULT_CAPACITY = 65_536


class BlockEventKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


class BlockEvent(NamedTuple):
    seq: int
    kind: BlockEventKind
    block_hash: bytes


class EventsSince(NamedTuple):
    """Events after `since` in order; `resync` means some were lost and the follower needs a snapshot."""

    events: list[BlockEvent]
    last_seq: int  # the newest sequence number issued so far (0 before any event)
    resync: bool


class BlockEventLog:
    """Thread-safe bounded event log; `capacity` events are kept, older ones are dropped."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._lock = threading.Lock()  # guards _events and _last_seq
        self._events: deque[BlockEvent] = deque(maxlen=capacity)
        self._last_seq = 0
        self.epoch = uuid.uuid4().hex[:16]

    def append(self, kind: BlockEventKind, block_hash: bytes) -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append(BlockEvent(self._last_seq, kind, block_hash))

    def stored(self, block_hash: bytes) -> None:
        self.append(BlockEventKind.STORED, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self.append(BlockEventKind.REMOVED, block_hash)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    def since(self, seq: int, limit: int = 10_000) -> EventsSince:
        """Up to `limit` events with sequence number > `seq`; resync when `seq` is too old or in the future."""
        with self._lock:
            last = self._last_seq
            oldest = self._events[0].seq if self._events else last + 1
            if seq > last or seq < oldest - 1:
                return EventsSince([], last, True)
            start = seq - oldest + 1
            events = [self._events[i] for i in range(start, min(len(self._events), start + limit))]
            return EventsSince(events, last, False)
