"""Warm start ([ssd] prefetch_on_start): read the hottest chains from the SSD into RAM after startup.

Runs on the worker thread (a block load creates MLX arrays), as small steps the worker takes only
while no request runs or waits: a request that arrives waits for one step at most (one header read
or one block load). Pinned chains come first, then the SSD's most recently used blocks; a block is
read after its ancestors (a lookup uses a chain from its root, so a deep block alone is no use), and
only while it fits the RAM budget as it is: nothing is evicted for it, pinned blocks stay within the
pinned share, and the prefetch stops at `max_bytes` or at the first block that does not fit. Tails
(partial blocks, checkpoints) are not prefetched: a lookup reads them from the SSD on first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from ...kv.base import Block
from ...kv.manager import KVManager
from ...kv.ssd import BlockHeader, SSDTier

log = logging.getLogger(__name__)


class Prefetcher:
    """`step()` does one unit of work and returns False once the prefetch is over. Not thread-safe:
    the worker thread calls it; `stats()` may be read from any thread (plain values)."""

    def __init__(self, manager: KVManager, tier: SSDTier, max_bytes: int = 0):
        """`max_bytes` <= 0: up to the RAM budget for blocks. Takes its snapshot of what is hot now."""
        self.manager = manager
        self.tier = tier
        ram = manager.stats()
        budget = ram["kv_ram_max_bytes"]
        self._room = min(max_bytes if max_bytes > 0 else budget, budget - ram["kv_ram_bytes"])
        self._pinned_room = int(budget * manager.pinned_ram_share) - ram["kv_pinned_ram_bytes"]
        stored = tier.store.recent_hashes()
        self._candidates: Iterator[bytes] = iter(dict.fromkeys([h for h, _ in manager.pins.items()] + stored))
        self._max_chain = len(stored) + 1  # a longer walk means a damaged parent link
        self._cursor: bytes | None = None  # the next header to read while walking up a chain
        self._walk: list[tuple[bytes, BlockHeader]] = []  # blocks found walking up, deepest first
        self._loading: list[tuple[bytes, BlockHeader]] = []  # to load, root last (popped first)
        self.num_blocks = 0
        self.num_bytes = 0
        self.ended = ""  # why it ended ("" while running)
        self._started = time.monotonic()
        self.elapsed_s = 0.0

    def step(self) -> bool:
        if self.ended:
            return False
        if self._loading:
            self._load_next()
        elif self._cursor is not None:
            self._walk_up()
        else:
            self._next_chain()
        if self.ended:
            self.elapsed_s = time.monotonic() - self._started
            log.info(
                "SSD prefetch: %d blocks (%.1f MiB) read into RAM in %.2f s; %s",
                self.num_blocks,
                self.num_bytes / 2**20,
                self.elapsed_s,
                self.ended,
            )
        return not self.ended

    def _next_chain(self) -> None:
        for block_hash in self._candidates:
            if not self.manager.in_ram(block_hash):
                self._cursor, self._walk = block_hash, []
                return
        self.ended = "every stored block is in RAM"

    def _walk_up(self) -> None:
        """Read one header; at the root, or at a block RAM holds, the chain is ready to load."""
        block_hash, self._cursor = self._cursor, None
        header = self.tier.header_of(block_hash)
        if header is None or len(self._walk) >= self._max_chain:  # gone or damaged: its chain is no use
            return
        self._walk.append((block_hash, header))
        parent = header.parent_hash
        if parent == self.manager.hasher.namespace or self.manager.in_ram(parent):
            self._loading = self._walk
        else:
            self._cursor = parent

    def _load_next(self) -> None:
        block_hash, header = self._loading.pop()
        if self.manager.in_ram(block_hash):  # a request read it meanwhile
            return
        loaded = self.tier.load(block_hash, header.token_ids)
        if loaded is None:  # damaged (the store deleted it): the blocks below it cannot be reached
            self._loading = []
            return
        payload, nbytes = self._fit(block_hash, *loaded)
        if payload is None:
            return
        block = Block(block_hash, header.parent_hash, header.token_ids, payload, nbytes)
        if not self.manager.add_prefetched(block):
            self.ended = "the RAM budget is full"
            return
        self.num_blocks += 1
        self.num_bytes += nbytes
        self._room -= nbytes
        if self.manager.pins.is_pinned(block_hash):
            self._pinned_room -= nbytes

    def _fit(self, block_hash: bytes, payload: Any, nbytes: int) -> tuple[Any, int]:
        """(payload, nbytes) when the block fits what is left, else (None, 0): a pinned block beyond
        the pinned share skips its chain; a block beyond the byte limit ends the prefetch."""
        if nbytes > self._room:
            self.ended = "the prefetch byte limit is reached"
            return None, 0
        if self.manager.pins.is_pinned(block_hash) and nbytes > self._pinned_room:
            self._loading = []
            return None, 0
        return payload, nbytes

    def stats(self) -> dict[str, Any]:
        return {
            "prefetch_blocks": self.num_blocks,
            "prefetch_bytes": self.num_bytes,
            "prefetch_done": bool(self.ended),
            "prefetch_s": round(self.elapsed_s, 3),
        }
