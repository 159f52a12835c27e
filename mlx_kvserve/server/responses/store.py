"""Responses kept in RAM for `previous_response_id` and `GET /v1/responses/{id}` (`store`, true by
default): least recently used dropped first past a count and a byte bound."""

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


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
    `max_entries` and about `max_bytes` of JSON, the least recently used dropped first (one
    response larger than `max_bytes` is not kept at all)."""

    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # guarded by _lock
        self._bytes = 0  # guarded by _lock: the sum of the entries' nbytes

    def put(self, body: dict[str, Any], items: list[dict[str, Any]]) -> None:
        nbytes = len(json.dumps(body)) + len(json.dumps(items))
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries[body["id"]] = StoredResponse(body, items, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def get(self, rid: str, param: str | None = None) -> StoredResponse:
        """The stored response `rid` (now the most recently used); NotFoundError (404) if none."""
        with self._lock:
            found = self._entries.get(rid)
            if found is not None:
                self._entries.move_to_end(rid)
                return found
        raise NotFoundError(f"response with id {rid!r} not found", param=param, code="response_not_found")

    def delete(self, rid: str) -> None:
        """Forget `rid`; NotFoundError (404) if it is not stored."""
        with self._lock:
            found = self._entries.pop(rid, None)
            if found is not None:
                self._bytes -= found.nbytes
                return
        raise NotFoundError(f"response with id {rid!r} not found", code="response_not_found")

    def history(self, rid: str) -> list[dict[str, Any]]:
        """The conversation a follow-up to `rid` continues: its input items, then its output."""
        found = self.get(rid, param="previous_response_id")
        return found.items + found.body["output"]
