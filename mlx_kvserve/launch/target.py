"""The server a launched client talks to: its base URL, the model id it serves, its context window and
the key it wants, read from a running server (`/health`, then `/v1/models`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, NamedTuple

NO_KEY = "unused"  # what a client sends to a server without a key (most clients insist on one)


class Target(NamedTuple):
    url: str  # base URL without /v1, no trailing slash
    model: str  # the served id clients name
    context_length: int  # the window the server tells clients (0: it did not say)
    api_key: str  # the key clients send: the server's, or NO_KEY

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def has_key(self) -> bool:
        return self.api_key != NO_KEY

    @property
    def secret(self) -> str:
        """The key to keep out of sight ("" when the server has none)."""
        return self.api_key if self.has_key else ""


class KeyRefused(Exception):
    """The server wants an API key, and not the one given (401 on /v1/models)."""


def get_json(url: str, api_key: str = "", timeout_s: float = 3.0) -> dict[str, Any] | None:
    """The JSON object at `url`, or None when nothing answers there, or not with 200 and an object.
    KeyRefused on a 401."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise KeyRefused(url) from None
        return None
    except (urllib.error.URLError, OSError, ValueError):  # refused, timed out, not JSON
        return None
    return body if isinstance(body, dict) else None


def probe(url: str, api_key: str = "") -> Target | None:
    """The server at `url` as clients see it, or None when no mlx-kvserve answers /health there.
    /health is open to all; the model card (with the key) adds the window where /health lacks it.
    KeyRefused when the server wants another key than `api_key` (or one, and none was given)."""
    url = url.rstrip("/")
    health = get_json(url + "/health")
    if health is None or "status" not in health:
        return None
    model, context = str(health.get("model") or "default"), _int(health.get("context_length"))
    cards = get_json(url + "/v1/models", api_key)
    data = cards.get("data") if cards else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        card = next((c for c in data if c.get("id") == model), data[0])
        model = str(card.get("id") or model)
        context = _int(card.get("context_length")) or context  # the window told (max_prompt_tokens applied)
    return Target(url, model, context, api_key or NO_KEY)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
