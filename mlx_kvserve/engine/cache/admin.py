"""Cache administration behind /v1/cache/*: pins, flush, prune, listing. Thread-safe (the KV
manager, pin registry and SSD store take their own locks); never touches MLX."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import ConflictError, InvalidRequestError, ValidationError
from ...kv.manager import KVManager
from .prefix_cache import PrefixCache

FLUSH_WAIT_S = 30.0  # how long a flush with ssd=true waits for writes queued before it


class CacheAdmin:
    def __init__(self, prefix_cache: PrefixCache):
        self.prefix_cache = prefix_cache

    @property
    def manager(self) -> KVManager:
        if self.prefix_cache.manager is None:
            raise InvalidRequestError(f"the block cache is off: {self.prefix_cache.reason}", code="cache_disabled")
        return self.prefix_cache.manager

    def block_hashes(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """Chained hashes of the full blocks of `tokens` (what a request with them would cache);
        `known`: the chain of a prompt `tokens` is a prefix of (or that is a prefix of `tokens`),
        when the caller has it."""
        return self.manager.hasher.hash_blocks(tokens, known=known)

    def missing(self, hashes: Sequence[bytes]) -> bool:
        """True when some of these blocks are in no tier (the prompt must be prefilled first)."""
        tier = self.prefix_cache.ssd_tier
        return any(not self.manager.in_ram(h) and not (tier is not None and tier.contains(h)) for h in hashes)

    def _owner_only(self, what: str) -> None:
        owner = self.prefix_cache.folder_owner
        if owner is not None:
            raise ConflictError(
                f"{what} belongs to the server that owns the cache folder ({owner}); this server shares the "
                "folder as a guest: send it there, or give this server its own ssd.cache_dir",
                code="cache_folder_guest",
            )

    def pin(self, hashes: Sequence[bytes], chain: bool = False) -> dict[str, Any]:
        """Pin blocks by hash (each with its ancestors, found through the tiers), or, with
        `chain`, a prompt's whole chain as computed from its tokens (root first). A guest server
        refuses (ConflictError): pins persist in the owner's folder state."""
        self._owner_only("pinning")
        if chain:
            self.manager.pins.pin(hashes)
            return {"pinned": [hashes[-1].hex()], "pinned_count": 1, "tokens": len(hashes) * self.manager.block_size}
        pinned = self.manager.pin(hashes)
        chains = {h for p in pinned for h in (self.manager.chain_of(p) or [p])}
        return {
            "pinned": [h.hex() for h in pinned],
            "pinned_count": len(pinned),
            "tokens": len(chains) * self.manager.block_size,
        }

    def unpin(self, hashes: Sequence[bytes], chain: bool = False) -> dict[str, Any]:
        self._owner_only("unpinning")
        if chain:
            if self.manager.pins.count(hashes[-1]) == 0:
                return {"unpinned_count": 0}
            self.manager.pins.unpin(hashes)
            return {"unpinned_count": 1}
        return {"unpinned_count": self.manager.unpin(hashes)}

    def lease(self, tokens: Sequence[int], ttl_s: float, known: Sequence[bytes] = ()) -> int:
        """Pin the full blocks of `tokens` for `ttl_s` (cache_control), or push out their lease.
        Returns the tokens leased (0 when leases are off or `tokens` holds no full block)."""
        leases = self.manager.pins.leases
        if leases is None:
            return 0
        chain = self.block_hashes(tokens, known)
        # One block's size for the cap: the chain's first, when RAM holds it (else the size last known).
        first = self.manager.blocks_in_ram(chain[:1])
        block_bytes = next(iter(first.values())).nbytes if first else 0
        return leases.grant(chain, ttl_s, block_bytes) * self.manager.block_size

    def touch_leases(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> int:
        """A request with this prompt: the leases it uses live their TTL again."""
        leases = self.manager.pins.leases
        return leases.touch(self.block_hashes(tokens, known)) if leases is not None else 0

    def leases(self) -> list[dict[str, Any]]:
        leases = self.manager.pins.leases
        return leases.items() if leases is not None else []

    def pins(self) -> list[dict[str, Any]]:
        tier = self.prefix_cache.ssd_tier
        return [
            {
                "block_hash": h.hex(),
                "pin_count": n,
                "in_ram": self.manager.in_ram(h),
                "on_ssd": tier is not None and tier.contains(h),
            }
            for h, n in sorted(self.manager.pins.items())
        ]

    def flush(self, include_ssd: bool) -> dict[str, Any]:
        out = self.manager.flush()
        tier = self.prefix_cache.ssd_tier
        if include_ssd:
            if tier is None:
                raise InvalidRequestError("there is no SSD tier to flush", param="ssd")
            self._owner_only("flushing the SSD tier")
            # Blocks queued before the flush would land after it: let the writer finish them first.
            out["ssd_writes_pending"] = tier.writer.wait_idle(FLUSH_WAIT_S)
            out["ssd_dropped"] = tier.store.remove_unpinned()
            out["ssd_tails_dropped"] = tier.tails.clear()
        out["pinned_blocks"] = len(self.manager.pins)
        return out

    def prune(self) -> dict[str, Any]:
        tier = self.prefix_cache.ssd_tier
        return {"pruned": tier.store.prune_expired() if tier is not None else 0}


def parse_hashes(raw: Any) -> list[bytes]:
    """Hex block hashes from a request body; raises InvalidRequestError naming the bad one."""
    if not isinstance(raw, list) or not raw:
        raise ValidationError("'block_hashes' must be a non-empty array of hex strings", param="block_hashes")
    out = []
    for i, value in enumerate(raw):
        try:
            digest = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValidationError(f"block_hashes[{i}] is not a 64-character hex hash", param="block_hashes")
        out.append(digest)
    return out
