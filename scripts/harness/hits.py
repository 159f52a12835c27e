"""Two views of a cache hit for the benches: mlx-lm's own one-cache path (what `mlx_lm.server` does for
one conversation, in process) and the arrays the product's hit joins per layer (issue 44)."""

from __future__ import annotations

import time

import numpy as np


class OneCache:
    """mlx-lm's own one-cache path, as `mlx_lm.server` serves one conversation: one prompt cache kept
    across requests, trimmed to the prefix the next prompt shares with the last (all but the last
    token of an exact repeat: one token must be computed), then the rest prefilled by stream_generate."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.cache: list | None = None
        self.tokens: list[int] = []

    def ttft(self, tokens: list[int]) -> tuple[float, int]:
        """(seconds to the first token, tokens reused from the cache)."""
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        start = time.perf_counter()
        common = shared_prefix(self.tokens, tokens, len(tokens) - 1)
        if self.cache is None or not common:
            self.cache = make_prompt_cache(self.loaded.model)
        else:  # the cache also holds the previous reply's token(s): cut back to the shared prefix
            trim_prompt_cache(self.cache, self.cache[0].offset - common)
        rest = tokens[common:]
        for _ in stream_generate(self.loaded.model, self.loaded.tokenizer, rest, max_tokens=1, prompt_cache=self.cache):
            break
        elapsed = time.perf_counter() - start
        self.tokens = list(tokens)
        return elapsed, common


def shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class JoinCounter:
    """The arrays each join of a hit takes (kv/cache_fill.py calls kv/concat.join_pair once per
    full-attention layer, kv/blocks.py once per window layer): the largest, per request, is the hit's
    array operations per layer."""

    def __init__(self):
        from mlx_kvserve.kv import blocks, cache_fill

        self.counts: list[int] = []
        real = blocks.join_pair

        def spy(keys, values):
            self.counts.append(len(keys))
            return real(keys, values)

        blocks.join_pair = cache_fill.join_pair = spy

    def per_layer(self, run) -> tuple[object, int]:
        """(run()'s result, the most arrays one join took while it ran; 0: nothing joined)."""
        self.counts.clear()
        result = run()
        return result, max(self.counts, default=0)
