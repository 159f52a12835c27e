"""The engine's side of block caching: look up and assemble before prefill, register after.

Runs on the worker thread (it touches MLX). When the model's cache cannot be cut into blocks,
`enabled` is False, `reason` says why, and every request simply starts from an empty cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..kv import blocks
from ..kv.base import MatchResult
from ..kv.manager import KVManager

log = logging.getLogger(__name__)


class Prepared(NamedTuple):
    prompt_cache: list[Any]
    match: MatchResult


class PrefixCache:
    def __init__(self, model: Any, manager: KVManager | None, reason: str = "", ssd_tier: Any = None):
        self.model = model
        self.manager = manager
        self.reason = reason
        self.ssd_tier = ssd_tier  # kv.tiering.SSDTier or None; the engine closes it at shutdown

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def prepare(self, prompt: Sequence[int]) -> Prepared:
        """A prompt cache holding the longest cached prefix of `prompt`, always leaving at least
        one token to prefill (its logits pick the first generated token). Background SSD writes
        are held from here until `first_token` (or `finish` / `release`)."""
        if self.ssd_tier is not None:
            self.ssd_tier.hold_writes()
        if self.manager is None:
            return Prepared(blocks.assemble(self.model, []), MatchResult([], 0))
        match = self.manager.lookup(prompt, max_tokens=len(prompt) - 1)
        try:
            cache = blocks.assemble(
                self.model,
                [b.payload for b in match.blocks],
                match.tail_payload,
                match.tail_tokens,
                room=len(prompt) - match.num_tokens,  # the prefill writes in place
            )
        except Exception:
            self.manager.release(match.blocks)
            raise
        return Prepared(cache, match)

    def _keep_tail(self, prompt_cache: list[Any], tokens: list[int], end: int, hashes: list[bytes]) -> None:
        """Keep tokens[start:end] as a tail, where start is the block boundary a later lookup of
        tokens[:end] (which may use at most end - 1 tokens) stops at. 1..block_size tokens."""
        if end < 1:
            return
        manager, bs = self.manager, self.manager.block_size
        num_blocks = (end - 1) // bs
        parent = hashes[num_blocks - 1] if num_blocks else manager.hasher.namespace
        payload, nbytes = blocks.slice_tokens(prompt_cache, num_blocks * bs, end)
        manager.cache_tail(parent, tokens[num_blocks * bs : end], payload, nbytes)

    def first_token(self) -> None:
        """The request's prefill is done: background SSD writes may go on."""
        if self.ssd_tier is not None:
            self.ssd_tier.resume_writes()

    def release(self, prepared: Prepared) -> None:
        """Drop the request's references without registering anything (the request failed)."""
        self.first_token()
        if self.manager is not None:
            self.manager.release(prepared.match.blocks)

    def finish(self, prepared: Prepared, kv_tokens: Sequence[int], prompt_len: int) -> int:
        """Release the request's blocks and register every new full block of the tokens whose
        KV the cache now holds, plus tails ending at the prompt's end and at the sequence's end.
        Returns the number of blocks registered."""
        self.first_token()
        if self.manager is None:
            return 0
        manager = self.manager
        try:
            bs = manager.block_size
            length = min(blocks.cache_length(prepared.prompt_cache), len(kv_tokens))
            tokens = list(kv_tokens[:length])
            num_full = length // bs
            first = len(prepared.match.blocks)
            hashes = manager.hasher.hash_blocks(tokens, num_full)  # once, for blocks and tails
            todo = manager.new_blocks(tokens, first, num_full, hashes)
            added = 0
            if todo:
                start, end = todo[0][0], todo[-1][0] + 1
                sliced = blocks.slice_blocks(prepared.prompt_cache, start, end, bs)
                for index, block_hash, parent in todo:
                    payload, nbytes = sliced[index - start]
                    added += manager.cache_block(
                        block_hash, parent, tokens[index * bs : (index + 1) * bs], payload, nbytes
                    )
            for end in {min(prompt_len, length), length}:
                self._keep_tail(prepared.prompt_cache, tokens, end, hashes)
            return added
        finally:
            manager.release(prepared.match.blocks)
