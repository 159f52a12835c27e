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
    def __init__(self, model: Any, manager: KVManager | None, reason: str = ""):
        self.model = model
        self.manager = manager
        self.reason = reason

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def prepare(self, prompt: Sequence[int]) -> Prepared:
        """A prompt cache holding the longest cached prefix of `prompt`, always leaving at least
        one token to prefill (its logits pick the first generated token)."""
        if self.manager is None:
            return Prepared(blocks.assemble(self.model, []), MatchResult([], 0))
        match = self.manager.lookup(prompt, max_tokens=len(prompt) - 1)
        try:
            cache = blocks.assemble(self.model, [b.payload for b in match.blocks])
        except Exception:
            self.manager.release(match.blocks)
            raise
        return Prepared(cache, match)

    def release(self, prepared: Prepared) -> None:
        """Drop the request's references without registering anything (the request failed)."""
        if self.manager is not None:
            self.manager.release(prepared.match.blocks)

    def finish(self, prepared: Prepared, kv_tokens: Sequence[int]) -> int:
        """Release the request's blocks and register every new full block of the tokens whose
        KV the cache now holds. Returns the number of blocks registered."""
        if self.manager is None:
            return 0
        manager = self.manager
        try:
            length = min(blocks.cache_length(prepared.prompt_cache), len(kv_tokens))
            tokens = list(kv_tokens[:length])
            first = prepared.match.num_tokens // manager.block_size
            todo = manager.new_blocks(tokens, first, length // manager.block_size)
            if not todo:
                return 0
            bs = manager.block_size
            start, end = todo[0][0], todo[-1][0] + 1
            sliced = blocks.slice_blocks(prepared.prompt_cache, start, end, bs)
            added = 0
            for index, block_hash, parent in todo:
                payload, nbytes = sliced[index - start]
                added += manager.cache_block(block_hash, parent, tokens[index * bs : (index + 1) * bs], payload, nbytes)
            return added
        finally:
            manager.release(prepared.match.blocks)
