"""A bound on one kind of work in flight, for work that runs on HTTP threads rather than the MLX worker.

A completion's heavy part waits its turn on the one MLX thread; a token count's (rendering and tokenizing
a body of up to max_body_bytes: about 0.5 GB and tens of CPU-seconds for 3 MB) runs on the thread pool at
once. Twelve of those took a server to 4.5 GB and slowed a small chat 40x, all within the in-flight limit
(issue 46). So such work holds a slot here too, and past the limit gets a 429 as the in-flight limit gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import OverloadedError


class Slots:
    """At most `limit` holders at once. Touched only on the event loop, so it needs no lock."""

    def __init__(self, limit: int, what: str, setting: str):
        assert limit >= 1, "a checked setting"
        self.limit = limit
        self.what = what  # e.g. "token counts"
        self.setting = setting  # named in the 429, so that an operator knows what to raise
        self.num_held = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold a slot for the block; OverloadedError (429) when all are held."""
        if self.num_held >= self.limit:
            raise OverloadedError(f"{self.limit} {self.what} are already running ({self.setting}); retry shortly")
        self.num_held += 1
        try:
            yield
        finally:
            self.num_held -= 1
