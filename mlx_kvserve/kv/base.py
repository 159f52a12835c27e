"""Shared types of the KV tiers. Payloads are opaque here: whatever the block<->cache adapter
produced, with a byte size; nothing in kv/ except blocks.py knows mlx-lm's cache classes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


@dataclass
class Block:
    """One full block of KV. `ref_count` counts in-flight requests using it ("in use"); a block in
    use is never evicted. `last_access` is a monotonic counter, not wall time. `depth`: the block's
    index in its chain (0: the first block of a prompt); the SSD writer sheds deep blocks first."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    payload: Any
    nbytes: int
    ref_count: int = 0
    last_access: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    depth: int = 0


class NewBlock(NamedTuple):
    """A full block to register (KVManager.cache_blocks); `depth`: its index in its chain."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    payload: Any
    nbytes: int
    depth: int = 0


class RequestBuffers(NamedTuple):
    """Where a chain is read for a request that takes it as its own cache (a direct read, kv/runs.py): arrays of
    `positions` positions (its prompt and room), the chain's first block after `lead_blocks` blocks
    (those RAM holds, which the request copies there)."""

    lead_blocks: int
    positions: int


class MatchResult(NamedTuple):
    """The longest verified cached prefix: its full blocks (referenced; release them), an
    optional partial tail after them (`tail_payload` holding `tail_len` >= `tail_tokens` tokens)
    and the total number of tokens covered."""

    blocks: list[Block]
    num_tokens: int
    tail_payload: Any = None
    tail_tokens: int = 0
    tail_len: int = 0  # the tail's own length (it may hold more positions than are used)
    # Blocks after `blocks` read from the next tier into the request's own buffers (a direct run,
    # kv/runs.py): not in RAM and not referenced; the request registers them when it is done.
    direct: Sequence[Block] = ()


class PrefixRules(Protocol):
    """Which cached prefixes can be assembled, for caches that are more than per-position KV
    (sliding windows, recurrent states). Without rules every chain of blocks is usable."""

    exact_tails: bool  # a tail is usable only whole (it carries a checkpoint at its end)

    def usable(self, payloads: Sequence[Any], tail: Any, tail_used: int, tail_len: int) -> bool: ...


class FrontCompute(Protocol):
    """Computes the front of a prefix the next tier holds while the back is being read (the
    engine's side; see KVManager.lookup). Blocks are numbered from the prompt's first."""

    def blocks_to_compute(self, start: int, stored: int) -> int:
        """Of the `stored` blocks from block `start` on that the next tier holds, how many to
        compute from the front instead of reading (0: read them all)."""
        ...

    def wants_a_read_sample(self) -> bool:
        """Whether it needs a read measured before it can split (one block is then read first)."""
        ...

    def compute(self, tokens: Sequence[int], before: Sequence[Any], start: int, count: int) -> list[tuple[Any, int]]:
        """(payload, nbytes) of blocks start..start+count-1 of `tokens`, computed on top of the
        payloads of the blocks before them."""
        ...
