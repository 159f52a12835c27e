"""Responses kept in RAM for `previous_response_id` and `GET /v1/responses/{id}` (`store`, true by
default): least recently used dropped first past a count and a byte bound. Each is its principal's
([cache] isolation = "per_key"): another key's lookup of it is a 404, as for an id never stored."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...errors import NotFoundError

MAX_STORED = 256
MAX_STORED_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as returned
    items: list[dict[str, Any]]  # the conversation's input items before this response's output
    nbytes: int
    owner: str = ""  # the principal that made it (gate.PRINCIPAL_KEY); "" without per_key isolation


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
    `max_entries` and about `max_bytes` of JSON, the least recently used dropped first (one
    response larger than `max_bytes` is not kept at all)."""

    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # guarded by _lock
        self._bytes = 0  # guarded by _lock: the sum of the entries' nbytes

    def put(self, body: dict[str, Any], items: list[dict[str, Any]], owner: str = "") -> None:
        nbytes = len(json.dumps(body)) + len(json.dumps(items))
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries[body["id"]] = StoredResponse(body, items, nbytes, owner)
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def get(self, rid: str, param: str | None = None, owner: str = "") -> StoredResponse:
        """The stored response `rid` of `owner` (now the most recently used); NotFoundError (404)
        if none, or if another principal's (the same answer: no id tells whose it is)."""
        with self._lock:
            found = self._entries.get(rid)
            if found is not None and found.owner == owner:
                self._entries.move_to_end(rid)
                return found
        raise NotFoundError(f"response with id {rid!r} not found", param=param, code="response_not_found")

    def delete(self, rid: str, owner: str = "") -> None:
        """Forget `rid` of `owner`; NotFoundError (404) if it is not stored, or another principal's."""
        with self._lock:
            found = self._entries.get(rid)
            if found is not None and found.owner == owner:
                del self._entries[rid]
                self._bytes -= found.nbytes
                return
        raise NotFoundError(f"response with id {rid!r} not found", code="response_not_found")

    def history(self, rid: str, owner: str = "") -> list[dict[str, Any]]:
        """The conversation a follow-up to `rid` continues: its input items, then its output."""
        found = self.get(rid, param="previous_response_id", owner=owner)
        return found.items + found.body["output"]
