"""The engine's Scheduler on a fresh block cache (RAM tier, optional SSD tier), driven directly: no server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.engine.batch.scheduler import Scheduler
from mlx_kvserve.engine.cache.prefix_cache import PrefixCache
from mlx_kvserve.kv import blocks
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.kv.ssd.store import SSDStore, store_dir
from mlx_kvserve.kv.ssd.tier import SSDTier
from mlx_kvserve.kv.ssd.writer import SSDWriterThread
from mlx_kvserve.kv.table_rules import table_expectation
from mlx_kvserve.kv.tails import TailStore

OPEN_TIERS: list[SSDTier] = []  # closed by conftest after each test: writer threads are non-daemon


@dataclass
class KVStack:
    """A Scheduler on its own block cache, for tests and in-process benchmarks (no worker thread):
    `run` one request to its end, or drive `scheduler` (admit, step) by hand."""

    scheduler: Scheduler

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.scheduler.prefix_cache

    @property
    def model(self) -> Any:
        return self.scheduler.model

    @property
    def tokenizer(self) -> Any:
        return self.scheduler.tokenizer

    def run(self, req: Any) -> None:
        self.scheduler.run(req)


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
) -> KVStack:
    """A Scheduler with a fresh RAM tier and, when `ssd_dir` is given, an SSD tier there (close
    it with `close_ssd` to drain the writer, as a server shutdown does)."""
    layout = blocks.cache_layout(model, block_size, kv_bits)
    namespace = namespace_hash("test-model", "float32", block_size, cache_layout=layout.signature)
    hasher = BlockHasher(namespace, block_size)
    tier = None
    if ssd_dir is not None:
        # The table rules as engine/build.py makes them: every file read back is checked against them.
        store = SSDStore(store_dir(ssd_dir, namespace), namespace, table_rules=table_expectation(layout))
        store.validate_index()
        holder: list[SSDTier] = []
        writer = SSDWriterThread(save_batch=lambda jobs: holder[0].save_jobs(jobs))  # as engine/build.py
        codec = (layout.to_arrays, layout.from_arrays)
        tier = SSDTier(
            store, writer, "write_through", *codec, write_hold_s=write_hold_s, exact_tails=layout.exact_tails
        )
        holder.append(tier)
        OPEN_TIERS.append(tier)
    tail_budget = ram_bytes // 2 if layout.has_state else ram_bytes // 8
    tail_store = TailStore(tail_budget, exact=layout.exact_tails) if tails else None
    rules = layout if layout.needs_checkpoints else None
    manager = KVManager(hasher, RAMStore(ram_bytes), tail_store, tier, rules=rules)
    prefix_cache = PrefixCache(model, manager, ssd_tier=tier, layout=layout, checkpoint_every=checkpoint_every)
    return KVStack(Scheduler(model, tokenizer, prefix_cache, prefill_step_size))


def server_attention(model=None, config=None) -> bool:
    """The CPU attention `mlx-kvserve run` installs (cpu/attention.py) for `model` (its layer count; None:
    as for several) under `config` (None: the defaults), so an in-process benchmark that builds an engine
    itself times what the server runs; nothing on a GPU."""
    from mlx_kvserve.config import Config
    from mlx_kvserve.cpu import attention as cpu_attention

    g = (config or Config()).generation
    layers = getattr(model, "layers", None)
    return cpu_attention.install(g.cpu_attention_rows, g.cpu_attention_softmax, None if layers is None else len(layers))


def close_ssd(generator: KVStack) -> bool:
    return generator.prefix_cache.ssd_tier.close(drain_timeout_s=30)
