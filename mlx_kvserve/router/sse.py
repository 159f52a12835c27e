"""Reading server-sent events from a backend: its replies (watch.py) and its block events (follower.py).

A stream's bytes are split into events as they arrive, in time linear in the stream whatever its chunks:
each byte is searched for an event's end once, and the bytes before the last end are dropped at once. An
event longer than the reader's bound is not held: its bytes are dropped as they arrive and it comes out as
None, so a backend cannot grow the router's memory with one endless event.
"""

from __future__ import annotations


class EventSplitter:
    """Feed it a stream's bytes in order; it returns the events they complete."""

    def __init__(self, max_event_bytes: int):
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()  # the unfinished event, with LF line ends
        self._scanned = 0  # bytes of _buffer already searched for an event's end
        self._skipping = False  # the unfinished event is over the bound: dropped as it arrives
        self._cr = False  # the last chunk ended in CR: it may be half of a CRLF

    @property
    def is_over_bound(self) -> bool:
        """The unfinished event is already over `max_event_bytes` (it will come out as None)."""
        return self._skipping

    def feed(self, chunk: bytes) -> list[bytes | None]:
        """The events `chunk` completes, in order: each one's bytes (LF line ends, without the blank line that
        ends it), or None for one over `max_event_bytes`."""
        if self._cr:
            chunk = b"\r" + chunk
        self._cr = chunk.endswith(b"\r")
        self._buffer += (chunk[:-1] if self._cr else chunk).replace(b"\r\n", b"\n")
        events: list[bytes | None] = []
        start = 0
        while (end := self._buffer.find(b"\n\n", max(start, self._scanned - 1))) >= 0:
            events.append(None if self._skipping else bytes(self._buffer[start:end]))
            self._skipping = False
            start = self._scanned = end + 2
        del self._buffer[:start]  # what is left came in this chunk, or is the unfinished event
        if len(self._buffer) > self.max_event_bytes:
            self._skipping = True
            del self._buffer[:-1]  # its last byte may begin the blank line that ends it
        self._scanned = len(self._buffer)
        return events


def fields(event: bytes) -> tuple[str, bytes]:
    """(name, data) of one event: the name "message" unless an `event:` line gives one; the `data:` lines
    joined by LF (b"" when there are none, as in a heartbeat's comment lines)."""
    name, data = "message", []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].strip())
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode(errors="replace")
    return name, b"\n".join(data)
