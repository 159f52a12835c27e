"""Shared-prefix arrival: a request whose uncached prefix another request is prefilling right now
waits for that request's blocks instead of computing the same KV again (eight agents sharing one
system prompt prefill it once). Pure functions of block hashes; the scheduler applies them (how many
leading blocks the RAM tier holds: PrefixCache.cached_in_ram)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def shared_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading block hashes two chained-hash sequences have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pick_leader(hashes: Sequence[bytes], prefilling: Mapping[int, Sequence[bytes]], num_cached: int) -> int | None:
    """The id of the prefilling request that shares the most blocks with `hashes` beyond the
    `num_cached` leading ones already cached; None when none shares more (then waiting gains
    nothing: the request starts now)."""
    best, best_shared = None, num_cached
    for uid, theirs in prefilling.items():
        shared = shared_blocks(hashes, theirs)
        if shared > best_shared:
            best, best_shared = uid, shared
    return best
