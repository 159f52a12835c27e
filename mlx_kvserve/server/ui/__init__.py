"""The /ui page: static files shipped in this package (no CDN, no build step) and the small
bounded log of recent requests it shows.

The files hold no data: the page fetches everything from the API with the key the user gives it,
so serving them needs no key, and the API's own checks decide what the page may see.
"""

from __future__ import annotations

import time
from collections import deque
from importlib import resources
from typing import Any, NamedTuple

from ..metrics import RequestRecord

STATIC = resources.files(__package__) / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
# Same-origin only: no inline script, nothing fetched from elsewhere, never framed; no Referer, so a
# key still in the address bar (/ui?key=...) is not sent anywhere.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


class Asset(NamedTuple):
    body: bytes
    content_type: str


def asset(name: str) -> Asset | None:
    """The static file `name`, or None for anything that is not one of ours: only plain file names
    are looked up, so no path can leave the folder."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    suffix = name[name.rfind(".") :] if "." in name else ""
    content_type = CONTENT_TYPES.get(suffix)
    path = STATIC / name
    if content_type is None or not path.is_file():
        return None
    return Asset(path.read_bytes(), content_type)


class RecentRequests:
    """The last `capacity` completion requests: ids, token counts, timings, status; never prompt or
    reply text. Touched only on the event loop (the middleware that records and the route that
    reads), so it needs no lock."""

    def __init__(self, capacity: int = 200, clock=time.time):
        self._items: deque[tuple[str, dict[str, Any]]] = deque(maxlen=capacity)  # (key name, item)
        self._clock = clock

    def add(self, record: RequestRecord) -> None:
        self._items.append(
            (
                record.key_name,
                {
                    "id": record.request_id,
                    "endpoint": record.endpoint,
                    "status": record.status,
                    "stream": record.stream,
                    "prompt_tokens": record.prompt_tokens,
                    "cached_tokens": record.cached_tokens,
                    "completion_tokens": record.completion_tokens,
                    "ttft_s": None if record.first_token_s is None else round(record.first_token_s, 4),
                    "duration_s": round(record.duration_s, 4),
                    "error": record.error or None,
                    "finished_at": round(self._clock(), 3),
                },
            )
        )

    def items(self, key_name: str | None = None) -> list[dict[str, Any]]:
        """Oldest first; with `key_name`, only the requests that key's principal made."""
        return [item for name, item in self._items if key_name is None or name == key_name]
