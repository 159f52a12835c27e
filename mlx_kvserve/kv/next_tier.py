"""Reading a chain's blocks from the tier after RAM (the SSD): the protocol that tier offers, and
the read of the blocks after RAM's last hit, with the first of them computed by a `FrontCompute`
while the rest are read (engine/cache/front_prefill.py). No lock is held here: the manager promotes what
comes back into RAM under its own."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..chain import BlockHasher
from .base import Block, FrontCompute, RequestBuffers

log = logging.getLogger(__name__)


class NextTier(Protocol):
    """Where blocks go after RAM (the SSD tier). Called outside the manager's lock."""

    def on_new_block(self, block: Block) -> None: ...
    def on_evicted(self, blocks: list[Block]) -> None: ...
    def load_many(
        self, wanted: Sequence[tuple[bytes, Sequence[int]]], into: RequestBuffers | None = None
    ) -> list[tuple[Any, int]]: ...
    def begin_load(self, wanted: Sequence[tuple[bytes, Sequence[int]]], into: RequestBuffers | None = None) -> Any: ...
    def end_load(self, pending: Any) -> list[tuple[Any, int]]: ...
    def stored_run(self, hashes: Sequence[bytes]) -> int: ...
    def contains(self, block_hash: bytes) -> bool: ...
    def persist(self, blocks: list[Block]) -> int: ...
    def parent_of(self, block_hash: bytes) -> bytes | None: ...
    def save_tail(self, parent_hash: bytes, token_ids: Sequence[int], payload: Any) -> None: ...
    def load_tail(self, parent_hash: bytes, rest: Sequence[int]) -> tuple[tuple[int, ...], Any, int, int] | None: ...
    def touch_tail(self, parent_hash: bytes, token_ids: Sequence[int]) -> None: ...


class NextTierReads:
    """Loads chains from `next_tier`; `on_split(computed)` counts each read split with a compute."""

    def __init__(self, next_tier: NextTier, hasher: BlockHasher, on_split: Callable[[int], None]):
        self.next_tier = next_tier
        self.hasher = hasher
        self.on_split = on_split

    def load(
        self,
        tokens: Sequence[int],
        hashes: list[bytes],
        start: int,
        found: Sequence[Block] = (),
        front: FrontCompute | None = None,
        positions: int | None = None,
    ) -> list[Block]:
        """Blocks start.. of the chain from the next tier, until its first miss (with `front`,
        the first ones computed while the rest are read). No lock held. `positions`: the blocks
        read go into buffers of that many positions that the request takes as its cache (a direct
        run, kv/runs.py) where the tier reads the chain as a run; those read before (a sample) or
        computed stay blocks of their own."""
        bs = self.hasher.block_size
        wanted = [(hashes[i], tuple(tokens[i * bs : (i + 1) * bs])) for i in range(start, len(hashes))]
        stored = self.next_tier.stored_run(hashes[start:]) if front is not None else 0
        if stored > 2 and front.wants_a_read_sample():  # no read measured yet: read one block, then split the rest
            first = self._blocks(hashes, wanted, start, self.next_tier.load_many(wanted[:1]), 0)
            if not first:
                return []
            return first + self.load(tokens, hashes, start + 1, [*found, *first], front, positions)
        computed = front.blocks_to_compute(start, stored) if stored > 1 else 0
        if not 0 < computed < stored:  # all or nothing computed: read them
            computed = 0
        into = RequestBuffers(start + computed, positions) if positions else None
        if computed:
            payloads = self._compute_and_load(tokens, wanted[:stored], found, start, computed, front, into)
        else:
            payloads = self.next_tier.load_many(wanted, into)
        return self._blocks(hashes, wanted, start, payloads, computed)

    def _blocks(
        self,
        hashes: list[bytes],
        wanted: list[tuple[bytes, tuple[int, ...]]],
        start: int,
        payloads: list[tuple[Any, int]],
        computed: int,
    ) -> list[Block]:
        """Blocks start.. built from their payloads; the first `computed` were prefilled, not read."""
        loaded = []
        for i, ((block_hash, ids), (payload, nbytes)) in enumerate(zip(wanted, payloads, strict=False), start):
            parent = hashes[i - 1] if i else self.hasher.namespace
            meta = {"computed": True} if i < start + computed else {}  # by the split: not read (kv_promotions)
            loaded.append(Block(block_hash, parent, ids, payload, nbytes, meta=meta))
        return loaded

    def _compute_and_load(
        self,
        tokens: Sequence[int],
        wanted: list[tuple[bytes, tuple[int, ...]]],
        found: Sequence[Block],
        start: int,
        computed: int,
        front: FrontCompute,
        into: RequestBuffers | None = None,
    ) -> list[tuple[Any, int]]:
        """The payloads of `wanted`: the first `computed` blocks by `front` while the next tier
        reads the rest (up to its first miss). A failed compute is a miss from `start` on (the
        request prefills those tokens itself, where a real fault shows in the request's own path)."""
        pending = self.next_tier.begin_load(wanted[computed:], into)
        try:
            front_payloads = front.compute(tokens, [b.payload for b in found], start, computed)
        except Exception as exc:
            log.warning("computing the front of an SSD hit failed (%s); its blocks are prefilled instead", exc)
            front_payloads = None
        finally:
            back = self.next_tier.end_load(pending)  # collected even if the compute failed
        if front_payloads is None:
            return []
        self.on_split(computed)
        return list(front_payloads) + back
