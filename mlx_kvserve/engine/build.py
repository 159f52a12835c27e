"""Assemble the engine's stack from the config: the block cache (RAM, tails, pins, leases), the
SSD tier with its writer and folder lock, and the front prefill of SSD hits.

`build_stack` is the one place that reads [cache] and [ssd] to wire kv/ together; the Engine
(engine/engine.py) holds what it returns and is the front the HTTP layer talks to.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

from blake3 import blake3

from ..chain import BlockHasher
from ..checked_json import DamagedFile
from ..config import Config, default_home
from ..fsmode import ensure_private_root, private_mkdir
from ..kv import blocks
from ..kv.hashing import model_fingerprint, namespace_hash
from ..kv.leases import LEASES_FILE, PinLeases
from ..kv.manager import KVManager
from ..kv.pins import PINS_FILE, PinRegistry
from ..kv.ram import RAMStore
from ..kv.ssd import FolderBusyError, FolderLock, SSDStore, SSDTier, SSDWriterThread, store_dir
from ..kv.ssd.budget import BUDGET_ROLE
from ..kv.ssd.folder_label import write_label
from ..kv.ssd.table_check import TableExpectation, save_rules
from ..kv.table_rules import table_expectation
from ..kv.tails import TailStore
from ..models.loader import LoadedModel
from .batch.state import SchedulerStats
from .cache.front_prefill import SPEEDS_FILE, FrontPrefill
from .cache.message_starts import turn_start_token
from .cache.prefix_cache import PrefixCache
from .distributed import World
from .memory.device import array_memory_bytes, bound_buffer_cache

log = logging.getLogger(__name__)

GPU_PREFILL_STEP = 2048  # mlx-lm's own default: fewer, larger passes keep a GPU busy
CPU_PREFILL_STEP = 512  # on the CPU short chunks cost nothing and keep the others' decode moving


def prefill_step(config: Config) -> int:
    """Prompt tokens per forward pass: [generation] prefill_step_size, or by device when 0.
    Measured on an H200 (docs/benchmarks-history-2026-12-07.md "GPU"): 512-token steps made a cold 8k prompt 1.18x
    slower than 2048-token ones; on the CPU 512 is as fast and interleaves better."""
    if config.generation.prefill_step_size > 0:
        return config.generation.prefill_step_size
    import mlx.core as mx

    return GPU_PREFILL_STEP if mx.default_device() == mx.gpu else CPU_PREFILL_STEP


class Stack(NamedTuple):
    """What build_stack assembles. `folder_lock`: held until the engine stops (None without an
    SSD folder). `stats`: the batch's counters, shared with the front prefill (its prefill speed).
    `damaged`: bookkeeping files set aside while building (the fingerprint memo)."""

    prefix_cache: PrefixCache
    folder_lock: FolderLock | None
    stats: SchedulerStats
    damaged: list[DamagedFile]


def build_stack(loaded: LoadedModel, config: Config, world: World | None = None) -> Stack:
    """The block cache for `loaded` as [cache] and [ssd] configure it (see build_prefix_cache), and
    MLX's buffer cache bounded as [server] mlx_cache_limit_bytes says (engine/memory/device.py). The CPU's
    attention is the CLI's to install (cpu/attention.py), not the engine's."""
    bound_buffer_cache(config.server.mlx_cache_limit_bytes)
    damaged: list[DamagedFile] = []
    stats = SchedulerStats()
    prefix_cache, folder_lock = build_prefix_cache(loaded, config, damaged, world, stats)
    return Stack(prefix_cache, folder_lock, stats, damaged)


def lock_store_folder(config: Config, namespace: bytes) -> FolderLock | None:
    """This namespace's folder under the SSD cache root (pins.json, blocks, tails, index), created
    private and locked for this server until Engine.stop: as its owner, or as a guest when another
    server owns it (kv/ssd/folder_lock.py). None when it cannot be created or locked (logged; pins then
    stay in memory and the SSD tier is off). Raises ConfigError when the root is a folder other
    users may read, FolderBusyError when an offline command (cache verify) holds the folder."""
    root = config.ssd_path()
    folder = store_dir(root, namespace)
    try:
        ensure_private_root(root, "ssd.cache_dir")
        private_mkdir(folder)
        lock = _acquire_server(folder)
    except OSError as exc:
        log.error("SSD tier off: cannot use %s (%s); pins will not persist", folder, exc)
        return None
    if not lock.is_owner:
        owner = f"pid {lock.owner.pid}" if lock.owner else "another server"
        log.warning(
            "the cache folder %s is owned by %s: this server shares it as a guest (reads and adds blocks; "
            "pins, eviction and pruning stay with the owner)",
            folder,
            owner,
        )
    return lock


def _acquire_server(folder: Path, wait_s: float = 10.0) -> FolderLock:
    """FolderLock.acquire_server, waiting out the shared SSD budget of this server (or another),
    which holds a folder at rest for the moment it takes to trim it (kv/ssd/budget.py)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return FolderLock.acquire_server(folder)
        except FolderBusyError as exc:
            if exc.holder is None or exc.holder.role != BUDGET_ROLE or time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def ssd_summary(folder: Path, stats: dict, policy: str, is_owner: bool, report, pruned: int) -> str:
    """The SSD tier's one startup line: what it holds of its budget, and what the startup check changed."""
    used, budget = stats.get("ssd_bytes", 0) / 2**30, stats.get("ssd_max_bytes", 0) / 2**30
    held = f"{used:.2f} of {budget:.2f} GiB" if budget else f"{used:.2f} GiB, no budget"
    fixes = [
        f"{n} {what}"
        for n, what in (
            (report.adopted, "adopted"),
            (report.dropped_missing, "missing dropped"),
            (report.deleted_invalid, "invalid deleted"),
            (report.deleted_temp, "temp files deleted"),
            (pruned, "past their TTL pruned"),
        )
        if n
    ]
    checked = ", ".join(fixes) if fixes else "all sound"
    return (
        f"SSD tier: {stats.get('ssd_blocks', report.kept + report.adopted)} blocks ({held}) in {folder}, "
        f"{policy}{'' if is_owner else ', as a guest'}; checked in {report.elapsed_s:.2f} s: {checked}"
    )


def _label_folder(folder: Path, loaded: LoadedModel) -> None:
    """Name the model in its cache folder, for `cache verify` (kv/ssd/folder_label.py)."""
    try:
        write_label(folder, loaded.name, str(loaded.path))
    except OSError as exc:
        log.warning("cannot write the model label in %s: %s", folder, exc)


WRITER_QUEUE_MIN_BYTES = 256 * 2**20  # the default queue bound never below this (a few batches)


def build_ssd_tier(
    config: Config,
    namespace: bytes,
    pins: PinRegistry,
    layout: blocks.CacheLayout,
    folder_lock: FolderLock | None = None,
    table_rules: TableExpectation | None = None,
    ram_bytes: int = 0,
) -> SSDTier | None:
    """The SSD tier for this namespace, validated and pruned, with its writer running; None when
    [ssd] is off or its folder cannot be used (the server then runs on RAM alone, logged). A guest
    (see folder_lock) only reads the folder's state and adds blocks. `table_rules`: what a block
    file's arrays may be (kv/table_rules.py), checked before each is read. `ram_bytes`: the RAM
    budget, which sizes the writer's queue when `ssd.writer_queue_bytes` is 0."""
    is_owner = folder_lock is None or folder_lock.is_owner
    ssd = config.ssd
    if not ssd.enabled:
        return None
    try:
        store = SSDStore(
            store_dir(config.ssd_path(), namespace),
            namespace,
            max_bytes=ssd.max_bytes,
            min_free_bytes=ssd.min_free_bytes,
            ttl_s=ssd.ttl_days * 86400.0,
            is_pinned=pins.is_pinned,
            is_owner=is_owner,
            table_rules=table_rules,
        )
    except OSError as exc:
        log.error("SSD tier off: cannot use %s (%s)", config.ssd_path(), exc)
        return None
    if is_owner and table_rules is not None:
        try:  # for `cache verify`, which has no model to read them from
            save_rules(store.cache_dir, table_rules)
        except OSError as exc:
            log.warning("cannot write the SSD table rules in %s: %s", store.cache_dir, exc)
    report = store.validate_index(others_write=folder_lock is not None and folder_lock.has_guests())
    pruned = store.prune_expired()
    log.info("%s", ssd_summary(store.cache_dir, store.stats(), ssd.policy, is_owner, report, pruned))
    holder: list[SSDTier] = []
    # The queue names the blocks' own arrays: it costs memory only for blocks RAM drops while queued.
    writer_queue_bytes = ssd.writer_queue_bytes or max(WRITER_QUEUE_MIN_BYTES, ram_bytes // 4)
    if ssd.writer_queue_size:
        log.warning(
            "[ssd] writer_queue_size is deprecated: the writer's queue is bounded by writer_queue_bytes "
            "(now %.0f MiB); the count bound of %d blocks still applies. Remove it to bound by bytes only.",
            writer_queue_bytes / 2**20,
            ssd.writer_queue_size,
        )
    writer = SSDWriterThread(
        save_batch=lambda jobs: holder[0].save_jobs(jobs),
        queue_size=ssd.writer_queue_size or None,
        queue_bytes=writer_queue_bytes,
        durability=ssd.durability,
        max_retries=ssd.persistent_max_retries,
        after_job=lambda: holder[0].after_write() if holder else None,
        when_full=ssd.writer_when_full,
        value=lambda job: holder[0].job_value(job),
        on_shed=lambda job: holder[0].forget_job(job),
    )
    tier = SSDTier(
        store,
        writer,
        ssd.policy,
        layout.to_arrays,
        layout.from_arrays,
        ssd.flush_interval_s,
        ssd.async_writes,
        ssd.write_hold_s,
        exact_tails=layout.exact_tails,
    )
    holder.append(tier)
    writer.attach_backlog(tier)  # blocks shed from its queue, taken back from RAM when it runs empty
    tier.validation = report._asdict()
    return tier


def build_prefix_cache(
    loaded: LoadedModel,
    config: Config,
    damaged: list[DamagedFile] | None = None,
    world: World | None = None,
    stats: SchedulerStats | None = None,
) -> tuple[PrefixCache, FolderLock | None]:
    """The block cache for this model, or a disabled one with the reason (logged once), and the
    lock on its cache folder (None when it uses none), which the caller releases at shutdown. A
    damaged fingerprint memo is appended to `damaged` (the stores keep their own damaged files).
    Raises ConfigError or FolderBusyError (see lock_store_folder).

    Distributed (`world`), each rank caches its own shard: the block hashes are the same on every
    rank (their namespace names the sharding, so one layout's blocks are never read under another),
    while each rank's files live in their own folder and carry the rank in their namespace."""
    if not config.cache.enabled:
        return PrefixCache(loaded.model, None, "disabled by configuration ([cache] enabled = false)"), None
    layout = blocks.cache_layout(loaded.model, config.cache.block_size, config.cache.kv_bits)
    # One hash chain on every rank (pins and lengths are compared across ranks): rank 0's layout
    # names it, whatever share of the layers this rank runs.
    signature = world.share(layout.signature) if world is not None else layout.signature
    if not layout.supported:
        log.warning("block caching is off for this model: %s", layout.reason)
        return PrefixCache(loaded.model, None, layout.reason, layout=layout), None
    fingerprint = model_fingerprint(loaded.path, default_home() / "fingerprints.json", damaged)
    sharding = f"|{world.tag}" if world is not None else ""
    namespace = namespace_hash(fingerprint, layout.kv_dtype, config.cache.block_size, cache_layout=signature + sharding)
    store_namespace = blake3(namespace + f"rank{world.rank}".encode()).digest() if world is not None else namespace
    budget = config.cache.ram_max_bytes or array_memory_bytes() // 4
    # Tails (partial last blocks) get an eighth of the RAM budget, full blocks the rest; for models
    # with recurrent layers tails carry the checkpoints, without which no block is usable: half.
    tails = TailStore(budget // 2 if layout.has_state else budget // 8, exact=layout.exact_tails)
    # The SSD's table rules come from a one-token forward: every rank runs it, whatever its folder does.
    table_rules = table_expectation(layout) if config.ssd.enabled else None
    folder_lock = lock_store_folder(config, store_namespace)  # before anything reads or writes the folder
    try:
        owns = folder_lock is not None and folder_lock.is_owner  # a guest keeps pins and leases in memory
        pins = PinRegistry(folder_lock.folder / PINS_FILE if owns else None, _leases(config, budget, folder_lock))
        ssd_tier = (
            build_ssd_tier(config, store_namespace, pins, layout, folder_lock, table_rules, budget)
            if folder_lock
            else None
        )
        if ssd_tier is not None and owns:
            _label_folder(folder_lock.folder, loaded)
    except BaseException:
        if folder_lock is not None:
            folder_lock.release()
        raise
    hasher = BlockHasher(namespace, config.cache.block_size)
    ram = RAMStore(budget - tails.max_bytes)
    rules = layout if layout.needs_checkpoints else None
    manager = KVManager(hasher, ram, tails, ssd_tier, pins, config.cache.pinned_ram_share, rules)
    if ssd_tier is not None:
        ssd_tier.attach_ram(manager.blocks_in_ram)  # blocks shed from the writer's queue are offered again
    log.info(
        "RAM tier: %.2f GiB for blocks of %d tokens + %.2f GiB for tails; SSD tier %s; model fingerprint %s",
        ram.max_bytes / 2**30,
        config.cache.block_size,
        tails.max_bytes / 2**30,
        "on" if ssd_tier else "off",
        fingerprint[:12],
    )
    prefix_cache = PrefixCache(
        loaded.model,
        manager,
        ssd_tier=ssd_tier,
        layout=layout,
        checkpoint_every=config.cache.checkpoint_every,
        turn_marker=turn_start_token(loaded.tokenizer),  # checkpoints (hybrid models) and tails (all)
        folder_owner=_owner_name(folder_lock),
        # Not for vision models: it computes blocks from token ids, and an image's KV needs its pixels.
        front=None
        if getattr(loaded, "vision", None) is not None
        else _front_prefill(loaded.model, layout, ssd_tier, config, stats or SchedulerStats()),
        agree=world.all_lengths if world is not None else None,
    )
    return prefix_cache, folder_lock


def _owner_name(folder_lock: FolderLock | None) -> str | None:
    """None when this server owns its folder (or has none), else who does ("pid N")."""
    if folder_lock is None or folder_lock.is_owner:
        return None
    return f"pid {folder_lock.owner.pid}" if folder_lock.owner else "another server"


def _leases(config: Config, ram_budget: int, folder_lock: FolderLock | None) -> PinLeases | None:
    """cache_control pins: at most [cache] cache_control_share of the RAM budget (and of the disk
    budget, when there is one); None when the share is 0."""
    share = config.cache.cache_control_share
    if share <= 0:
        return None
    budgets = [ram_budget] + ([config.ssd.max_bytes] if config.ssd.enabled and config.ssd.max_bytes > 0 else [])
    owns = folder_lock is not None and folder_lock.is_owner
    return PinLeases(folder_lock.folder / LEASES_FILE if owns else None, int(share * min(budgets)))


def _front_prefill(
    model: Any, layout: blocks.CacheLayout, tier: SSDTier | None, config: Config, stats: SchedulerStats
) -> FrontPrefill | None:
    """Compute an SSD hit's first blocks while the rest are read ([ssd] compute_while_loading),
    for plain-KV layouts; the split follows the measured read and prefill speeds."""
    if tier is None or layout.needs_checkpoints or not config.ssd.compute_while_loading:
        return None
    front = FrontPrefill(
        model,
        layout,
        config.cache.block_size,
        prefill_step(config),
        tier.block_reads.bytes_per_s,
        lambda: stats.prefill_tokens / stats.prefill_s if stats.prefill_s else None,
    )
    front.remember(tier.store.cache_dir / SPEEDS_FILE)
    return front
