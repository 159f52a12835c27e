"""The RAM hot tier: a byte-budgeted LRU of blocks. Not thread-safe: KVManager's lock guards it.
Blocks entering and leaving are reported to kv/runs.py, which frees the memory of runs mostly gone."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from . import runs
from .base import Block


class RAMStore:
    """Blocks by hash in LRU order (oldest first). `evict_to_budget` drops least recently used
    blocks that are not in use until the total fits `max_bytes`; blocks in use are skipped, so
    the store may stay over budget while requests hold them. Evicting 0 blocks is always safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __iter__(self) -> Iterator[Block]:
        return iter(list(self._blocks.values()))

    def check(self, block_size: int) -> None:
        """Raise AssertionError if the books do not balance: bytes, block sizes, references, LRU order."""
        blocks = list(self)
        assert sum(b.nbytes for b in blocks) == self.used_bytes, "ram bytes do not add up"
        assert all(b.ref_count >= 0 for b in blocks), "negative reference count"
        assert all(len(b.token_ids) == block_size for b in blocks), "block of wrong size"
        ticks = [b.last_access for b in blocks]
        assert ticks == sorted(ticks), "LRU order does not follow last access"

    def get(self, block_hash: bytes) -> Block | None:
        return self._blocks.get(block_hash)

    def oldest_tick(self) -> int:
        """The least recently used block's access tick (0 when empty)."""
        return next(iter(self._blocks.values())).last_access if self._blocks else 0

    def touch(self, block: Block, tick: int) -> None:
        block.last_access = tick
        self._blocks.move_to_end(block.block_hash)

    def insert(self, block: Block, tick: int, oldest: bool = False) -> None:
        """Add a block as most recently used (`oldest`: least; `tick` then below `oldest_tick()`).
        The caller checked it is not present."""
        assert block.block_hash not in self._blocks
        block.last_access = tick
        self._blocks[block.block_hash] = block
        if oldest:
            self._blocks.move_to_end(block.block_hash, last=False)
        self.used_bytes += block.nbytes
        runs.entered(block.payload)

    def remove(self, block_hash: bytes) -> Block | None:
        block = self._blocks.pop(block_hash, None)
        if block is not None:
            self.used_bytes -= block.nbytes
            runs.left(block.payload)
        return block

    def evict_to_budget(
        self, max_bytes: int | None = None, can_evict: Callable[[Block], bool] | None = None
    ) -> list[Block]:
        """Evict LRU blocks that are not in use (and pass `can_evict`) until used_bytes <= budget;
        return what was evicted."""
        budget = self.max_bytes if max_bytes is None else max_bytes
        evicted: list[Block] = []
        if self.used_bytes <= budget:
            return evicted
        for block in list(self._blocks.values()):
            if self.used_bytes <= budget:
                break
            if block.ref_count == 0 and (can_evict is None or can_evict(block)):
                self.remove(block.block_hash)
                evicted.append(block)
        return evicted
