"""Stop strings over streamed text: emit what can no longer become part of a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text pieces; get back the text that is safe to send.

    Text that could still be the start of a stop string is held back until the next piece
    decides it. When a stop string appears, everything before it is released and `stopped`
    becomes true; the stop string itself and anything after it are dropped.
    """

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self._stops:
            return text
        buf = self._held + text
        cut = min((i for s in self._stops if (i := buf.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return buf[:cut]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of generation when no stop string completed."""
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
