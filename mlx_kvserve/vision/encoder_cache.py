"""Vision-encoder outputs by image digest: a byte-bounded LRU in RAM.

A conversation re-sends its earlier screenshots with every turn; when the block cache no longer
holds the KV after them (a new turn edits an earlier message, or the blocks were evicted), the
image still needs its embeddings, and this cache saves re-running the vision tower for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class EncoderCache:
    """Features (arrays with `nbytes`) by digest, at most `max_bytes` in all (0: off). An entry
    larger than the whole budget is not kept. Thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # guards _entries, used_bytes and the counters
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, digest: bytes) -> Any | None:
        with self._lock:
            features = self._entries.get(digest)
            if features is None:
                self.misses += 1
                return None
            self._entries.move_to_end(digest)
            self.hits += 1
            return features

    def put(self, digest: bytes, features: Any) -> None:
        size = int(features.nbytes)
        with self._lock:
            if size > self.max_bytes or digest in self._entries:
                return
            self._entries[digest] = features
            self.used_bytes += size
            while self.used_bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.used_bytes -= int(old.nbytes)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "encoder_cache_entries": len(self._entries),
                "encoder_cache_bytes": self.used_bytes,
                "encoder_cache_hits": self.hits,
                "encoder_cache_misses": self.misses,
            }
