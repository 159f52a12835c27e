"""KVManager: the block index over the tiers (RAM now; the SSD tier plugs in as `next_tier`).

Contract:
- `lookup(tokens)` returns the longest chain of cached blocks whose token ids equal the
  prompt's, and references each returned block (in use: never evicted) until `release`.
- A hash hit whose token ids differ is a collision: counted, treated as a miss.
- `cache_block` is two-phase: phase 1 registers the block in RAM under the lock; phase 2,
  outside the lock, hands it to the next tier (disk I/O never happens under the lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from ..chain import BlockHasher
from . import runs
from .base import Block, FrontCompute, MatchResult, NewBlock, PrefixRules
from .events import BlockEventLog
from .next_tier import NextTier, NextTierReads
from .pins import PinRegistry
from .ram import RAMStore
from .salts import tail_parent
from .tails import Tail, TailMatch, TailStore

log = logging.getLogger(__name__)


class KVManager:
    def __init__(
        self,
        hasher: BlockHasher,
        ram: RAMStore,
        tails: TailStore | None = None,
        next_tier: NextTier | None = None,
        pins: PinRegistry | None = None,
        pinned_ram_share: float = 0.5,
        rules: PrefixRules | None = None,
    ):
        self.hasher = hasher
        self.rules = rules  # None: every chain of blocks is usable (plain attention KV)
        self.pins = pins if pins is not None else PinRegistry(None)
        self.pinned_ram_share = pinned_ram_share
        self.block_size = hasher.block_size
        self.next_tier = next_tier
        self._reads = NextTierReads(next_tier, hasher, self._count_split) if next_tier is not None else None
        self._lock = threading.Lock()  # guards _ram, _tails, _tick and _stats
        self._ram = ram
        self._tails = tails
        self._tick = 0
        self.num_flushes = 0  # flush() calls so far: registrations deferred across one are dropped
        # Blocks entering and leaving RAM, for routers; appended under _lock, so in the order RAM changed.
        self.events = BlockEventLog()
        self._stats = dict.fromkeys(
            (
                "lookups",
                "hits",
                "hit_tokens",
                "misses",
                "collisions",
                "evictions",
                "inserts",
                "dedup",
                "promotions",
                "pinned_demotions",
                "pinned_dropped",
                "tail_hits",
                "tail_hit_tokens",
                "split_loads",
                "split_computed_blocks",
            ),
            0,
        )

    def _count_split(self, computed: int) -> None:
        with self._lock:
            self._stats["split_loads"] += 1
            self._stats["split_computed_blocks"] += computed

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def lookup(
        self,
        tokens: Sequence[int],
        max_tokens: int | None = None,
        front: FrontCompute | None = None,
        hashes: Sequence[bytes] | None = None,
        root: bytes | None = None,
        positions: int | None = None,
    ) -> MatchResult:
        """Longest verified cached prefix of `tokens`, at most `max_tokens` long: full blocks from
        RAM, then from the next tier (loaded outside the lock and promoted into RAM), then a tail.
        With `rules`, the longest such prefix the rules accept: shorter chains (and the tails
        after them) are tried until one is usable (the empty prefix always is).
        With `front`, the next tier's blocks are read from the back while `front` computes the
        first of them (as many as it asks for): the computed blocks join RAM like loaded ones.
        `hashes`: the chain of `tokens` (or of a prefix of it) when the caller has it already.
        `root`: the principal's (kv/salts.py): its chain's root, and the key of its tails.
        `positions` (plain attention KV, no rules): the next tier may read the chain into buffers of
        that many positions the request takes as its cache (a direct run, kv/runs.py); those blocks
        come back in `direct`, not in RAM nor referenced, until it registers them (`read=True`)."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        bs = self.block_size
        hashes = self.hasher.hash_blocks(tokens, limit // bs, known=hashes or (), root=root)
        with self._lock:
            self._stats["lookups"] += 1
            found, missed = self._walk_ram(tokens, hashes)
        direct: list[Block] = []
        if missed and self.next_tier is not None:
            loaded = self._reads.load(
                tokens, hashes, len(found), found, front, positions if self.rules is None else None
            )
            direct = [b for b in loaded if runs.is_direct(b.payload)]  # the last ones; a sample or computed go first
            if len(direct) < len(loaded):
                self._promote(loaded[: len(loaded) - len(direct)], found)
        num_blocks, tail = self._choose_end(tokens, found + direct, limit, root)
        if tail is not None and self.next_tier is not None:
            # A use on the SSD too: its per-parent limit keeps what RAM keeps for the next restart.
            self.next_tier.touch_tail(tail.tail.parent_hash, tail.tail.token_ids)
        if num_blocks < len(found):  # with rules only: then nothing is read direct
            self.release(found[num_blocks:])
            found = found[:num_blocks]
        with self._lock:
            self._stats["promotions"] += len(direct)  # loaded from the next tier now, in RAM later
            self._stats["hits"] += num_blocks
            self._stats["hit_tokens"] += num_blocks * bs
            if tail is not None:
                self._stats["tail_hits"] += 1
                self._stats["tail_hit_tokens"] += tail.num_tokens
        if tail is None:
            return MatchResult(found, num_blocks * bs, direct=direct)
        used, held = tail.num_tokens, len(tail.tail.token_ids)
        return MatchResult(found, num_blocks * bs + used, tail.tail.payload, used, held, direct=direct)

    def _choose_end(
        self, tokens: Sequence[int], found: list[Block], limit: int, root: bytes | None
    ) -> tuple[int, TailMatch | None]:
        """How many of the found blocks to use, and the tail after them (no lock held)."""
        bs, rules = self.block_size, self.rules
        for k in range(len(found), -1, -1):
            parent = tail_parent(found[k - 1].block_hash if k else self.hasher.namespace, root)
            tail = self._match_tail(parent, tokens[k * bs : limit])
            if rules is None:
                return k, tail
            payloads = [b.payload for b in found[:k]]
            if tail is not None and rules.usable(
                payloads, tail.tail.payload, tail.num_tokens, len(tail.tail.token_ids)
            ):
                return k, tail
            if rules.usable(payloads, None, 0, 0):
                return k, None
        return 0, None

    def _match_tail(self, parent: bytes, rest: Sequence[int]) -> TailMatch | None:
        """The best tail under `parent` for `rest`: from RAM, else from the next tier."""
        if self._tails is None or not rest:
            return None
        with self._lock:
            tail = self._tails.match(parent, rest)
        if tail is None and self.next_tier is not None:
            tail = self._load_tail(parent, rest)
        return tail

    def _load_tail(self, parent: bytes, rest: Sequence[int]) -> TailMatch | None:
        """A tail from the next tier (no lock held), kept in RAM from then on."""
        loaded = self.next_tier.load_tail(parent, rest)
        if loaded is None:
            return None
        token_ids, payload, nbytes, shared = loaded
        tail = Tail(parent, tuple(token_ids), payload, nbytes)
        with self._lock:
            self._tails.add(tail)
        return TailMatch(tail, shared)

    def _walk_ram(self, tokens: Sequence[int], hashes: list[bytes]) -> tuple[list[Block], bool]:
        """Referenced RAM blocks of the chain, and whether it stopped at a plain miss. Lock held."""
        bs, found, missed = self.block_size, [], False
        for i, block_hash in enumerate(hashes):
            block = self._ram.get(block_hash)
            if block is None:
                self._stats["misses"] += 1
                missed = True
                break
            if block.token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                self._stats["collisions"] += 1
                log.warning("block hash collision at block %d (%s); treated as a miss", i, block_hash.hex()[:16])
                break
            block.ref_count += 1
            found.append(block)
        self._touch_chain(found)
        return found, missed

    def _touch_chain(self, chain: Sequence[Block]) -> None:
        """Mark a chain's blocks used, its deepest least recently: a full RAM tier then gives up a
        chain from its deep end, never its head (without which the rest cannot be found). Lock held."""
        for block in reversed(chain):
            self._ram.touch(block, self._next_tick())

    def _evict(self) -> list[Block]:
        """Bring RAM within budget. Lock held.
        1. Safety net: pinned blocks may hold at most `pinned_ram_share` of the budget; beyond it
           they are served from the next tier (demoted, never lost) or, with no next tier,
           dropped from RAM (logged), so pins can never starve requests of RAM.
        2. Unpinned blocks not in use, least recently used first.
        3. Still over budget: pinned blocks the next tier holds are demoted."""
        pinned = self.pins.is_pinned
        tier = self.next_tier
        evicted: list[Block] = []
        share = int(self._ram.max_bytes * self.pinned_ram_share)
        pinned_bytes = sum(b.nbytes for b in self._ram if pinned(b.block_hash)) if len(self.pins) else 0
        if pinned_bytes > share:
            target = self._ram.used_bytes - (pinned_bytes - share)
            if tier is not None:
                moved = self._ram.evict_to_budget(
                    target, lambda b: pinned(b.block_hash) and tier.contains(b.block_hash)
                )
                self._stats["pinned_demotions"] += len(moved)
            else:
                moved = self._ram.evict_to_budget(target, lambda b: pinned(b.block_hash))
                if moved:
                    log.warning(
                        "pinned blocks exceed %d%% of the RAM budget and there is no SSD tier: dropped %d from RAM",
                        self.pinned_ram_share * 100,
                        len(moved),
                    )
                self._stats["pinned_dropped"] += len(moved)
            evicted += moved
        evicted += self._ram.evict_to_budget(can_evict=lambda b: not pinned(b.block_hash))
        if tier is not None and self._ram.used_bytes > self._ram.max_bytes:
            moved = self._ram.evict_to_budget(can_evict=lambda b: tier.contains(b.block_hash))
            self._stats["pinned_demotions"] += len(moved)
            evicted += moved
        for block in evicted:
            self.events.removed(block.block_hash)
        self._stats["evictions"] += len(evicted)
        return evicted

    # --- pins -----------------------------------------------------------------------------------

    def chain_of(self, block_hash: bytes) -> list[bytes] | None:
        """The block and its ancestors (root first), or None when the block is not cached."""
        chain, current = [], block_hash
        while current != self.hasher.namespace:
            with self._lock:
                block = self._ram.get(current)
                parent = block.parent_hash if block is not None else None
            if parent is None and self.next_tier is not None:
                parent = self.next_tier.parent_of(current)
            if parent is None:
                return None if current == block_hash else chain[::-1]
            chain.append(current)
            current = parent
        return chain[::-1]

    def pin(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Pin each known block and its ancestors; unknown hashes pin nothing. Returns the hashes
        that were pinned (each with its chain). All or nothing: one pins-file write, and
        InsufficientStorageError, pinning nothing, when it fails."""
        pinned, chains, counted = [], set(), []
        for block_hash in block_hashes:
            chain = self.chain_of(block_hash)
            if chain:
                counted += chain  # ancestors shared by two pinned blocks count twice, as two pins
                pinned.append(block_hash)
                chains.update(chain)
        if counted:
            self.pins.pin(counted)
        if chains and self.next_tier is not None:  # so a pinned block can always be demoted, never lost
            with self._lock:
                resident = [b for b in self._ram if b.block_hash in chains]
            self.next_tier.persist(resident)
        return pinned

    def unpin(self, block_hashes: Sequence[bytes]) -> int:
        """Remove one pin from each pinned block and its ancestors. Returns how many were unpinned.
        All or nothing, as `pin`."""
        removed: dict[bytes, int] = {}  # pins taken off so far, so a hash named twice is seen as it will be
        counted = []
        for block_hash in block_hashes:
            if self.pins.count(block_hash) > removed.get(block_hash, 0):
                chain = self.chain_of(block_hash) or [block_hash]
                for h in chain:
                    removed[h] = removed.get(h, 0) + 1
                counted.append(chain)
        if counted:
            self.pins.unpin([h for chain in counted for h in chain])
        return len(counted)

    def flush(self) -> dict[str, int]:
        """Drop every RAM block that is neither in use nor pinned, and all tails."""
        with self._lock:
            dropped = [b for b in self._ram if b.ref_count == 0 and not self.pins.is_pinned(b.block_hash)]
            for block in dropped:
                self._ram.remove(block.block_hash)
                self.events.removed(block.block_hash)
            kept = len(self._ram)
            if self._tails is not None:
                self._tails.clear()
            self.num_flushes += 1
        return {"ram_dropped": len(dropped), "ram_kept": kept}

    def resident_blocks(self) -> list[Block]:
        """The blocks in RAM now, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._ram)

    def blocks_in_ram(self, hashes: Sequence[bytes]) -> dict[bytes, Block]:
        """Those of `hashes` RAM holds now (the SSD writer takes back blocks shed from its queue)."""
        with self._lock:
            return {h: block for h in hashes if (block := self._ram.get(h)) is not None}

    def in_ram(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._ram

    def _promote(self, loaded: list[Block], found: list[Block]) -> None:
        """Put blocks read from the next tier into RAM, referenced, after `found`."""
        with self._lock:
            for block in loaded:
                present = self._ram.get(block.block_hash)
                if present is not None:  # another request promoted it meanwhile
                    block = present
                else:
                    self._ram.insert(block, self._next_tick())
                    self.events.stored(block.block_hash)
                    if not block.meta.pop("computed", False):
                        self._stats["promotions"] += 1
                block.ref_count += 1
                found.append(block)
            self._touch_chain(found)
            evicted = self._evict()
        if evicted:
            self.next_tier.on_evicted(evicted)

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block (the request that looked them up is done)."""
        with self._lock:
            for block in blocks:
                assert block.ref_count > 0, "release without a matching lookup"
                block.ref_count -= 1
            evicted = self._evict()
        if evicted and self.next_tier is not None:
            self.next_tier.on_evicted(evicted)

    def cache_block(
        self,
        block_hash: bytes,
        parent_hash: bytes,
        token_ids: Sequence[int],
        payload: Any,
        nbytes: int,
        write: bool = True,
        depth: int = 0,
    ) -> bool:
        """Register one new full block (see `cache_blocks`). False when it was already cached (or collides)."""
        new = NewBlock(block_hash, parent_hash, tuple(token_ids), payload, nbytes, depth)
        return bool(self.cache_blocks([new], (), write))

    def cache_blocks(
        self, new: Sequence[NewBlock], chain: Sequence[bytes], write: bool = True, read: bool = False
    ) -> list[Block]:
        """Register new full blocks of one chain (`depth`: each one's index in it), and mark the
        chain's blocks in RAM used (`chain`: its hashes from the root, the new blocks' among them),
        the root most recently: RAM evicts a chain from its deep end. Returns the blocks added
        (those already cached, or colliding, are not). `write=False`: not handed to the next tier
        yet (see `write_deferred`); the others go to it in chain order. `read`: blocks the next
        tier gave a request (MatchResult.direct): counted by that lookup, never handed back to it."""
        added = []
        with self._lock:  # phase 1: RAM registration
            for entry in new:
                existing = self._ram.get(entry.block_hash)
                if existing is not None:
                    self._stats["dedup" if existing.token_ids == entry.token_ids else "collisions"] += 1
                    continue
                block = Block(*entry[:5], depth=entry.depth)
                self._ram.insert(block, self._next_tick())
                self.events.stored(block.block_hash)
                if not read:  # blocks read were counted by the lookup that read them
                    self._stats["inserts"] += 1
                added.append(block)
            held = []  # the chain's run from its root (blocks after a gap are found by no lookup)
            for block_hash in chain:
                if (block := self._ram.get(block_hash)) is None:
                    break
                held.append(block)
            self._touch_chain(held)
            evicted = self._evict()  # once all are in: the choice sees the chain's order, not arrival's
        if self.next_tier is not None:  # phase 2: outside the lock
            if write and not read:
                for block in added:
                    self.next_tier.on_new_block(block)
            if evicted:
                self.next_tier.on_evicted(evicted)
        return added

    def add_prefetched(self, block: Block) -> bool:
        """Put a block read ahead from the next tier into RAM, unreferenced, if it fits the RAM
        budget as it is: nothing is evicted for it. False when it is there already or does not fit.
        It goes in as the least recently used (unused yet; read root first, a chain's deep end is
        then evicted before its head)."""
        with self._lock:
            if block.block_hash in self._ram or self._ram.used_bytes + block.nbytes > self._ram.max_bytes:
                return False
            self._ram.insert(block, self._ram.oldest_tick() - 1, oldest=True)
            self.events.stored(block.block_hash)
        return True

    def write_deferred(self, blocks: Sequence[Block]) -> None:
        """Hand blocks registered with `write=False` to the next tier now, as `cache_block` would
        have (also those RAM evicted meanwhile: a write-through tier must still get them)."""
        if self.next_tier is not None:
            for block in blocks:
                self.next_tier.on_new_block(block)

    def cache_tail(self, parent_hash: bytes, token_ids: Sequence[int], payload: Any, nbytes: int) -> bool:
        """Keep the partial block after `parent_hash` (RAM only). False when not kept."""
        if self._tails is None or not token_ids:
            return False
        with self._lock:
            added = self._tails.add(Tail(parent_hash, tuple(token_ids), payload, nbytes))
        if added and self.next_tier is not None:  # outside the lock: disk I/O
            self.next_tier.save_tail(parent_hash, token_ids, payload)
        return added

    def new_blocks(
        self, tokens: Sequence[int], start_block: int, end_block: int, hashes: Sequence[bytes] | None = None
    ) -> list[tuple[int, bytes, bytes]]:
        """(index, hash, parent hash) of blocks start..end-1 of `tokens` not yet in RAM. `hashes`:
        the chain of `tokens` if the caller has it already (at least end_block long)."""
        hashes = self.hasher.hash_blocks(tokens, end_block) if hashes is None else hashes[:end_block]
        with self._lock:
            return [
                (i, hashes[i], hashes[i - 1] if i else self.hasher.namespace)
                for i in range(start_block, len(hashes))
                if hashes[i] not in self._ram
            ]

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"kv_{k}": v for k, v in self._stats.items()}
            out["kv_ram_bytes"] = self._ram.used_bytes
            out["kv_ram_blocks"] = len(self._ram)
            out["kv_ram_max_bytes"] = self._ram.max_bytes
            out["kv_in_use_blocks"] = sum(1 for b in self._ram if b.ref_count > 0)
            out["kv_pinned_blocks"] = len(self.pins)
            out["kv_pinned_ram_bytes"] = sum(b.nbytes for b in self._ram if self.pins.is_pinned(b.block_hash))
            out["kv_tails"] = len(self._tails) if self._tails is not None else 0
            out["kv_tail_bytes"] = self._tails.used_bytes if self._tails is not None else 0
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError if the RAM tier's books do not balance (RAMStore.check, TailStore.check)."""
        with self._lock:
            self._ram.check(self.block_size)
            if self._tails is not None:
                self._tails.check(self.block_size)
            blocks = list(self._ram)
            if self._ram.used_bytes > self._ram.max_bytes:
                assert all(b.ref_count > 0 or self.pins.is_pinned(b.block_hash) for b in blocks), (
                    "over budget while unreferenced, unpinned blocks remain"
                )
            pinned = {h for h, _ in self.pins.items()}
            ram = {b.block_hash for b in blocks}
        if self.next_tier is not None:  # no pinned block lost (pending writes aside: drain first)
            missing = [h for h in pinned if h not in ram and not self.next_tier.contains(h)]
            assert not missing, f"{len(missing)} pinned blocks are in no tier"
