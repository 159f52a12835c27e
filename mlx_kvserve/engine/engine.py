"""The engine: a loaded model, its tokenizer and the worker thread that owns MLX.

The HTTP layer talks only to this class: it tokenizes prompts (thread-safe, no MLX) and submits
GenerationRequests; everything that touches MLX happens on the worker thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from blake3 import blake3

from ..checked_json import DamagedFile
from ..config import Config, default_home
from ..errors import ModelLoadError
from ..kv import blocks
from ..kv.folder_lock import FolderLock
from ..kv.fsmode import ensure_private_root, private_mkdir
from ..kv.hashing import BlockHasher, model_fingerprint, namespace_hash
from ..kv.leases import LEASES_FILE, PinLeases
from ..kv.manager import KVManager
from ..kv.pins import PINS_FILE, PinRegistry
from ..kv.ram import RAMStore
from ..kv.ssd import SSDStore, store_dir
from ..kv.tails import TailStore
from ..kv.tiering import SSDTier
from ..kv.writer import SSDWriterThread
from ..models.loader import LoadedModel
from . import tool_grammar
from .cache_admin import CacheAdmin
from .constrain import grammars_for
from .distributed import BroadcastAdmin, DistributedWorker, World
from .front_prefill import SPEEDS_FILE, FrontPrefill
from .generate import Generator
from .prefetch import Prefetcher
from .prefix_cache import PrefixCache
from .request import Failed, GenerationRequest, SamplingParams
from .scheduler import SchedulerStats
from .turns import turn_start_token
from .worker import InferenceWorker

log = logging.getLogger(__name__)

RANKS_TIMEOUT_S = 10.0  # distributed: how long /health waits for every rank's cache statistics
# Of each rank's cache statistics, what /health lists per rank.
RANK_KEYS = ("enabled", "kv_ram_blocks", "kv_ram_bytes", "kv_tails", "kv_pinned_blocks", "kv_hits", "ssd_blocks")


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def lock_store_folder(config: Config, namespace: bytes) -> FolderLock | None:
    """This namespace's folder under the SSD cache root (pins.json, blocks, tails, index), created
    private and locked for this server until Engine.stop: as its owner, or as a guest when another
    server owns it (kv/folder_lock.py). None when it cannot be created or locked (logged; pins then
    stay in memory and the SSD tier is off). Raises ConfigError when the root is a folder other
    users may read, FolderBusyError when an offline command (cache verify) holds the folder."""
    root = config.ssd_path()
    folder = store_dir(root, namespace)
    try:
        ensure_private_root(root, "ssd.cache_dir")
        private_mkdir(folder)
        lock = FolderLock.acquire_server(folder)
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


def build_ssd_tier(
    config: Config,
    namespace: bytes,
    pins: PinRegistry,
    layout: blocks.CacheLayout,
    folder_lock: FolderLock | None = None,
) -> SSDTier | None:
    """The SSD tier for this namespace, validated and pruned, with its writer running; None when
    [ssd] is off or its folder cannot be used (the server then runs on RAM alone, logged). A guest
    (see folder_lock) only reads the folder's state and adds blocks."""
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
        )
    except OSError as exc:
        log.error("SSD tier off: cannot use %s (%s)", config.ssd_path(), exc)
        return None
    report = store.validate_index(others_write=folder_lock is not None and folder_lock.has_guests())
    pruned = store.prune_expired()
    log.info(
        "SSD tier at %s: %d blocks kept, %d adopted, %d missing dropped, %d invalid deleted, %d temp deleted, "
        "%d pruned (%.2fs)",
        store.cache_dir,
        report.kept,
        report.adopted,
        report.dropped_missing,
        report.deleted_invalid,
        report.deleted_temp,
        pruned,
        report.elapsed_s,
    )
    holder: list[SSDTier] = []
    writer = SSDWriterThread(
        save_batch=lambda jobs: holder[0].save_jobs(jobs),
        queue_size=ssd.writer_queue_size,
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
    tier.validation = report._asdict()
    return tier


def build_prefix_cache(
    loaded: LoadedModel, config: Config, damaged: list[DamagedFile] | None = None, world: World | None = None
) -> tuple[PrefixCache, FolderLock | None]:
    """The block cache for this model, or a disabled one with the reason (logged once), and the
    lock on its cache folder (None when it uses none), which the caller releases at shutdown. A
    damaged fingerprint memo is appended to `damaged` (the stores keep their own damaged files).
    Raises ConfigError or FolderBusyError (see lock_store_folder).

    Distributed (`world`), each rank caches its own shard: the block hashes are the same on every
    rank (their namespace names the sharding, so one layout's blocks are never read under another),
    while each rank's files live in their own folder and carry the rank in their namespace."""
    if not config.cache.enabled:
        return PrefixCache(loaded.model, None, "disabled by configuration ([cache] enabled = false)", layout=None), None
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
    budget = config.cache.ram_max_bytes or physical_memory_bytes() // 4
    # Tails (partial last blocks) get an eighth of the RAM budget, full blocks the rest; for models
    # with recurrent layers tails carry the checkpoints, without which no block is usable: half.
    tails = TailStore(budget // 2 if layout.has_state else budget // 8, exact=layout.exact_tails)
    folder_lock = lock_store_folder(config, store_namespace)  # before anything reads or writes the folder
    try:
        owns = folder_lock is not None and folder_lock.is_owner  # a guest keeps pins and leases in memory
        pins = PinRegistry(folder_lock.folder / PINS_FILE if owns else None, _leases(config, budget, folder_lock))
        ssd_tier = build_ssd_tier(config, store_namespace, pins, layout, folder_lock) if folder_lock else None
    except BaseException:
        if folder_lock is not None:
            folder_lock.release()
        raise
    hasher = BlockHasher(namespace, config.cache.block_size)
    ram = RAMStore(budget - tails.max_bytes)
    rules = layout if layout.needs_checkpoints else None
    manager = KVManager(hasher, ram, tails, ssd_tier, pins, config.cache.pinned_ram_share, rules)
    log.info(
        "block cache on: %d-token blocks, RAM budget %.2f GiB, SSD %s, model %s",
        config.cache.block_size,
        budget / 2**30,
        "on" if ssd_tier else "off",
        fingerprint[:12],
    )
    prefix_cache = PrefixCache(
        loaded.model,
        manager,
        ssd_tier=ssd_tier,
        layout=layout,
        checkpoint_every=config.cache.checkpoint_every,
        turn_marker=turn_start_token(loaded.tokenizer) if layout.needs_checkpoints else None,
        folder_owner=_owner_name(folder_lock),
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


def _front_prefill(prefix_cache: PrefixCache, config: Config, stats: SchedulerStats) -> FrontPrefill | None:
    """Compute an SSD hit's first blocks while the rest are read ([ssd] compute_while_loading),
    for plain-KV layouts; the split follows the measured read and prefill speeds."""
    tier = prefix_cache.ssd_tier
    if tier is None or prefix_cache.layout.needs_checkpoints or not config.ssd.compute_while_loading:
        return None
    front = FrontPrefill(
        prefix_cache.model,
        prefix_cache.layout,
        config.cache.block_size,
        config.generation.prefill_step_size,
        tier.block_reads.bytes_per_s,
        lambda: stats.prefill_tokens / stats.prefill_s if stats.prefill_s else None,
    )
    front.remember(tier.store.cache_dir / SPEEDS_FILE)
    return front


class Engine:
    """The model, its block cache and the worker that runs the batch. Distributed (`world`), one
    per rank: rank 0's serves HTTP; the others run `serve_follower` (engine/distributed.py)."""

    def __init__(self, loaded: LoadedModel, config: Config, world: World | None = None):
        self.loaded = loaded
        self.config = config
        self.world = world
        reason = blocks.unbatchable(loaded.model)
        if reason:  # every request would fail: refuse to start instead
            raise ModelLoadError(f"model {loaded.name} cannot be served: {reason}")
        self._memo_damage: list[DamagedFile] = []  # a fingerprint memo set aside at startup
        # The folder lock is held from here to stop(): one process per cache folder.
        self.prefix_cache, self.folder_lock = build_prefix_cache(loaded, config, self._memo_damage, world)
        self.generator = Generator(
            loaded.model,
            loaded.tokenizer,
            self.prefix_cache,
            config.generation.prefill_step_size,
            config.server.batch_limit(),
        )
        self.prefix_cache.front = _front_prefill(self.prefix_cache, config, self.generator.scheduler.stats)
        if world is None:
            self.worker = InferenceWorker(self.generator, config.server.max_queue)
        else:
            self.prefix_cache.agree = world.all_lengths
            self.worker = DistributedWorker(self.generator, config.server.max_queue, world, self._execute)
        self.started_at = time.time()
        self.prefetcher: Prefetcher | None = None  # set by start() with [ssd] prefetch_on_start

    def _execute(self, name: str, args: tuple) -> Any:
        """A cache command on this rank (distributed: run on every rank by the worker)."""
        if name == "stats":
            return self.local_cache_stats()
        return getattr(CacheAdmin(self.prefix_cache), name)(*args)

    def cache_admin(self) -> CacheAdmin:
        """Cache administration for the HTTP routes: distributed, pins, unpins, flushes and prunes
        run on every rank (each holds its shard of every block)."""
        if self.world is None:
            return CacheAdmin(self.prefix_cache)
        return BroadcastAdmin(self.prefix_cache, self.worker)

    def serve_follower(self) -> None:
        """Ranks other than 0: run the batch on rank 0's updates until it stops, then shut down."""
        try:
            self.worker.run_follower()
        finally:
            self.stop(0)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        """How many tokens the model scores: its config's vocab_size (0 when it names none)."""
        config = self.loaded.config
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        return size if isinstance(size, int) and size > 0 else 0

    def start(self) -> None:
        """Start the worker; with [ssd] prefetch_on_start, it reads the hottest chains from the SSD
        into RAM while no request runs (engine/prefetch.py)."""
        manager, tier = self.prefix_cache.manager, self.prefix_cache.ssd_tier
        if self.config.ssd.prefetch_on_start and manager is not None and tier is not None:
            if self.world is None:
                self.prefetcher = Prefetcher(manager, tier, self.config.ssd.prefetch_max_bytes)
                self.worker.start(self.prefetcher.step)
                return
            log.warning("[ssd] prefetch_on_start is not supported with --distributed; the ranks start cold")
        self.worker.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the worker, then drain the SSD writer and flush its index (in that order: the
        worker is the writer's only producer). Under evict_only the blocks still in RAM are
        written first. The cache folder's lock goes last, when nothing writes there any more."""
        self.worker.stop(timeout)
        tier, manager = self.prefix_cache.ssd_tier, self.prefix_cache.manager
        if tier is not None:
            if manager is not None:
                queued = tier.persist_resident(manager.resident_blocks())
                if queued:
                    log.info("evict_only: writing %d blocks still in RAM before exit", queued)
            if self.prefix_cache.front is not None and tier.store.is_owner:
                self.prefix_cache.front.save(tier.store.cache_dir / SPEEDS_FILE)
            tier.close(self.config.ssd.drain_timeout_s)
        if self.folder_lock is not None:
            self.folder_lock.release()

    def submit(self, req: GenerationRequest) -> None:
        self.worker.submit(req)

    def prefill(self, tokens: list[int], timeout: float | None = None) -> None:
        """Run `tokens` through the worker (one generated token, discarded) and block until its KV
        blocks are registered. Raises the worker's error; OverloadedError when the queue is full."""
        done = threading.Event()
        failure: list[Exception] = []

        def emit(event: Any) -> None:
            if isinstance(event, Failed):
                failure.append(event.error)

        req = GenerationRequest(
            f"prefill-{uuid.uuid4().hex[:12]}", tokens, SamplingParams(max_tokens=1), emit, on_done=done.set
        )
        self.submit(req)
        if not done.wait(timeout):
            req.cancel()
            raise TimeoutError(f"prefill of {len(tokens)} tokens did not finish in {timeout} s")
        if failure:
            raise failure[0]

    def pin_files(self, paths: list[str]) -> None:
        """[cache] pin_on_start: each file's text as a system prompt, warmed and pinned. A file
        that cannot be used is logged and skipped: startup never fails for it."""
        manager = self.prefix_cache.manager
        for path in paths:
            try:
                text = Path(path).expanduser().read_text()
                tokens = self.chat_tokens([{"role": "system", "content": text}], add_generation_prompt=False)
                hashes = manager.hasher.hash_blocks(tokens) if manager is not None else []
                if not hashes:
                    log.warning("pin_on_start: %s is shorter than one block; not pinned", path)
                    continue
                self.prefill(tokens)
                if manager.pins.count(hashes[-1]) == 0:  # once: pins persist across restarts
                    manager.pins.pin(hashes)
                log.info("pin_on_start: %s pinned (%d blocks)", path, len(hashes))
            except Exception as exc:  # a bad file must not stop the server
                log.error("pin_on_start: %s not pinned: %s", path, exc)

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages` under the model's chat template (by default ready for the
        assistant's turn, exactly as a chat request renders them), with `tools` (OpenAI's shape)
        and `template_kwargs` (e.g. enable_thinking) given to the template."""
        tokenizer = self.loaded.tokenizer
        extra = dict(template_kwargs or {})
        if tools:  # only when given: a template that takes no tools renders as before
            extra["tools"] = tools
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra))

    def check_schema(self, schema: dict[str, Any]) -> str:
        """Why structured output cannot enforce this JSON schema ("" when it can). Any thread."""
        return grammars_for(self.loaded.tokenizer).check(schema)

    def call_grammar(self, prompt: list[int], spec: tool_grammar.CallGrammar) -> str:
        """The Lark grammar that holds a reply to `spec`'s tool calls, checked by llguidance;
        UnsupportedCallFormat when the model's format has none or the grammar cannot be enforced."""
        text = tool_grammar.build(self.loaded.tokenizer, prompt, spec)
        problem = grammars_for(self.loaded.tokenizer).check_lark(text)
        if problem:
            raise tool_grammar.UnsupportedCallFormat(problem)
        return text

    def text_tokens(self, prompt: str) -> list[int]:
        return list(self.loaded.tokenizer.encode(prompt))

    def cache_stats(self) -> dict[str, Any]:
        """This server's cache statistics; distributed, rank 0's plus every rank's under "ranks"
        (gathered; "ranks_error" says why when the ranks did not answer)."""
        stats = self.local_cache_stats()
        if self.world is None:
            return stats
        try:
            ranks = self.worker.run_command("stats", timeout=RANKS_TIMEOUT_S)
        except Exception as exc:  # a rank is gone or the batch is stuck
            stats["ranks_error"] = str(exc) or type(exc).__name__
            return stats
        world = self.world
        stats["world"] = {
            "mode": world.mode,
            "size": world.size,
            "collectives": world.collectives,  # rank 0's: updates, agreements, gathers
            "collective_s": round(world.collective_s, 4),
        }
        stats["ranks"] = [{k: r.get(k) for k in RANK_KEYS if k in r} for r in ranks]
        return stats

    def local_cache_stats(self) -> dict[str, Any]:
        manager = self.prefix_cache.manager
        layout = self.prefix_cache.layout
        if manager is None:
            return {"enabled": False, "reason": self.prefix_cache.reason, "layers": layout.describe()}
        out = {"enabled": True, "block_size": manager.block_size, "layers": layout.describe(), **manager.stats()}
        if layout.needs_checkpoints:
            out["checkpoint_every"] = self.prefix_cache.checkpoint_every
        if layout.kv_bits:
            out["kv_bits"] = layout.kv_bits
        tier = self.prefix_cache.ssd_tier
        if tier is not None:
            out.update(tier.stats())
            out["ssd_role"] = "owner" if tier.store.is_owner else "guest"
            out["ssd_startup_validation"] = tier.validation
            out.update(tier.last_shutdown)
            if self.prefetcher is not None:
                out.update({f"ssd_{k}": v for k, v in self.prefetcher.stats().items()})
        out["damaged_files"] = [damaged.as_json() for damaged in self.damaged_files()]
        return out

    def damaged_files(self) -> list[DamagedFile]:
        """Bookkeeping files found damaged at startup, each set aside and rebuilt: the fingerprint
        memo, the pins and leases files, the SSD index, the shutdown record and the speeds file."""
        found = list(self._memo_damage)
        manager, tier = self.prefix_cache.manager, self.prefix_cache.ssd_tier
        if manager is not None:
            found += manager.pins.damaged_files
            if manager.pins.leases is not None:
                found += manager.pins.leases.damaged_files
        if tier is not None:
            found += tier.store.damaged_files + tier.damaged_files
        if self.prefix_cache.front is not None:
            found += self.prefix_cache.front.damaged_files
        return found

    def batch_stats(self) -> dict[str, Any]:
        """The batch: requests running (in the batch, or waiting there for a shared prefix) and
        waiting to join it, the requests in mlx-lm's batch now, and prefill and decode work since
        start (tokens, seconds spent, and their ratio in tokens/s)."""
        scheduler = self.generator.scheduler
        s = scheduler.stats
        return {
            "running": self.worker.num_running,
            "waiting": self.worker.queue_depth,
            "batch_size": scheduler.batch_size,
            "max_batch": scheduler.max_batch,
            "prefill_tokens": s.prefill_tokens,
            "prefill_s": round(s.prefill_s, 3),
            "prefill_tokens_per_s": round(s.prefill_tokens / s.prefill_s, 1) if s.prefill_s else 0.0,
            "decode_tokens": s.decode_tokens,
            "decode_s": round(s.decode_s, 3),
            "decode_tokens_per_s": round(s.decode_tokens / s.decode_s, 1) if s.decode_s else 0.0,
            "shared_prefix_waits": s.shared_prefix_waits,
        }

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "queue_depth": self.worker.queue_depth,
            "busy": self.worker.is_busy,
            "batch": self.batch_stats(),
            "context_length": self.context_length,
            "cache": self.cache_stats(),
        }
