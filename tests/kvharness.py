"""Drive the engine's Generator directly (no server) with a fresh block cache."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prefix_cache import PrefixCache
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from mlx_kvserve.kv import blocks
from mlx_kvserve.kv.hashing import BlockHasher, namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.kv.ssd import SSDStore, store_dir
from mlx_kvserve.kv.tails import TailStore
from mlx_kvserve.kv.tiering import SSDTier
from mlx_kvserve.kv.writer import SSDWriterThread

OPEN_TIERS: list[SSDTier] = []  # closed by conftest after each test: writer threads are non-daemon


def make_generator(
    model,
    tokenizer,
    block_size: int,
    ram_bytes: int = 1 << 30,
    tails: bool = True,
    ssd_dir: Path | None = None,
    write_hold_s: float = 0.0,
    checkpoint_every: int = 0,
    prefill_step_size: int = 512,
    kv_bits: int = 0,
) -> Generator:
    """A Generator with a fresh RAM tier and, when `ssd_dir` is given, an SSD tier there (close
    it with `close_ssd` to drain the writer, as a server shutdown does)."""
    layout = blocks.cache_layout(model, block_size, kv_bits)
    namespace = namespace_hash("test-model", "float32", block_size, cache_layout=layout.signature)
    hasher = BlockHasher(namespace, block_size)
    tier = None
    if ssd_dir is not None:
        store = SSDStore(store_dir(ssd_dir, namespace), namespace)
        store.validate_index()
        holder: list[SSDTier] = []
        writer = SSDWriterThread(lambda *job: holder[0].save_job(*job))
        tier = SSDTier(
            store,
            writer,
            "write_through",
            layout.to_arrays,
            layout.from_arrays,
            write_hold_s=write_hold_s,
            exact_tails=layout.exact_tails,
        )
        holder.append(tier)
        OPEN_TIERS.append(tier)
    tail_budget = ram_bytes // 2 if layout.has_state else ram_bytes // 8
    tail_store = TailStore(tail_budget, exact=layout.exact_tails) if tails else None
    rules = layout if layout.needs_checkpoints else None
    manager = KVManager(hasher, RAMStore(ram_bytes), tail_store, tier, rules=rules)
    prefix_cache = PrefixCache(model, manager, ssd_tier=tier, layout=layout, checkpoint_every=checkpoint_every)
    return Generator(model, tokenizer, prefix_cache, prefill_step_size)


def close_ssd(generator: Generator) -> bool:
    return generator.prefix_cache.ssd_tier.close(drain_timeout_s=30)


def greedy(generator: Generator, prompt: list[int], max_tokens: int) -> tuple[tuple[int, ...], str, int]:
    """(completion token ids, text, cached tokens) of a greedy run through the engine."""
    events: list = []
    req = GenerationRequest("test", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), events.append)
    generator.run(req)
    done = events[-1]
    assert isinstance(done, Finished), events
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return done.token_ids, text, done.usage.cached_tokens


def final_logits(generator: Generator, prompt: list[int]) -> tuple[mx.array, int]:
    """Logits after `prompt`, computed on top of whatever the block cache holds for it, plus the
    number of tokens served from cache. The cold reference is the same call on an empty cache."""
    prepared = generator.prefix_cache.prepare(prompt)
    try:
        cached = prepared.match.num_tokens
        logits = generator.model(mx.array(prompt[cached:])[None], cache=prepared.prompt_cache)[0, -1]
        mx.eval(logits)
        return logits.astype(mx.float32), cached
    finally:
        generator.prefix_cache.release(prepared)


def cold_logits(model, prompt: list[int]) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0, -1]
    mx.eval(logits)
    return logits.astype(mx.float32)
