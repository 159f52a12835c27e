"""The engine: a loaded model, its tokenizer and the worker thread that owns MLX.

The HTTP layer talks only to this class: it tokenizes prompts (thread-safe, no MLX) and submits
GenerationRequests; everything that touches MLX happens on the worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..checked_json import DamagedFile
from ..config import Config
from ..errors import ModelLoadError
from ..kv import blocks
from ..kv.salts import CacheSalts, principal_chain
from ..models.loader import LoadedModel
from ..vision.runtime import build_runtime
from .batch import kv_room
from .batch.order import StartOrder
from .batch.scheduler import Scheduler
from .build import build_stack, prefill_step
from .cache import token_memo
from .cache.admin import CacheAdmin
from .cache.front_prefill import SPEEDS_FILE
from .cache.prefetch import Prefetcher
from .cache.router_view import RouterView
from .distributed import BroadcastAdmin, DistributedWorker, World
from .memory import device as device_memory
from .memory.facts import plan_for
from .memory.plan import planned_config
from .request import Failed, GenerationRequest, SamplingParams
from .sampling import tool_grammar
from .sampling.constrain import grammars_for
from .speculative.draft import draft_ram_share, load_draft
from .speculative.speculator import build_speculator
from .worker import InferenceWorker

log = logging.getLogger(__name__)

RANKS_TIMEOUT_S = 10.0  # distributed: how long /health waits for every rank's cache statistics
# Of each rank's cache statistics, what /health lists per rank.
RANK_KEYS = ("enabled", "kv_ram_blocks", "kv_ram_bytes", "kv_tails", "kv_pinned_blocks", "kv_hits", "ssd_blocks")


class Engine:
    """The model, its block cache and the worker that runs the batch. Distributed (`world`), one
    per rank: rank 0's serves HTTP; the others run `serve_follower` (engine/distributed.py)."""

    def __init__(self, loaded: LoadedModel, config: Config, world: World | None = None, share_bytes: int = 0):
        """`share_bytes`: one of several models (registry/registry.py), planned within their shared budget."""
        reason = blocks.unbatchable(loaded.model)
        if reason:  # every request would fail: refuse to start instead
            raise ModelLoadError(f"model {loaded.name} cannot be served: {reason}")
        # The memory plan (engine/memory/plan.py): the KV budgets beside the weights; ConfigError when
        # an explicit one does not fit. Everything below is built from the planned config.
        self.memory_plan = plan_for(loaded, config, share_bytes)
        if world is not None:  # ranks admit alike only on one plan: rank 0's
            self.memory_plan = world.share(self.memory_plan)
        log.info("%s%s", f"{loaded.name}: " if share_bytes else "", self.memory_plan.line())
        self._wires = not share_bytes  # Metal's wired limit set by start(); a registry wires the models' budget
        self.loaded, self.world = loaded, world
        text_alone = world is None and getattr(loaded, "vision", None) is None  # what speculates
        # The draft model's block cache takes its share of the planned KV budget (speculative/draft.py).
        config, draft_ram = draft_ram_share(planned_config(self.memory_plan, config), text_alone)
        self.config = config
        # The folder lock is held from here to stop(): one process per cache folder.
        stack = build_stack(loaded, config, world)
        self.prefix_cache, self.folder_lock = stack.prefix_cache, stack.folder_lock
        self._memo_damage = stack.damaged  # a fingerprint memo set aside at startup
        # A vision-language model's images (vision/runtime.py): prompts built here, prefilled by the scheduler.
        self.vision = build_runtime(loaded.vision, config) if getattr(loaded, "vision", None) is not None else None
        budget = config.server.kv_batch_bytes  # admission by memory: the batch's KV bounded, the context capped
        self.kv_room = kv_room.for_model(loaded.model, loaded.config, budget, config.cache.kv_bits)
        # Speculative decoding (engine/speculative/speculator.py): text models on one machine (ranks measure
        # their own pass times, and their adaptive choices must not differ). [speculative]
        # draft_model is loaded here (ConfigError when its tokenizer is not this model's).
        self.speculation = (
            build_speculator(
                loaded.model,
                loaded.tokenizer,
                self.prefix_cache.layout,
                config.speculative.mode,
                config.speculative.max_draft_tokens,
                load_draft(config, loaded.tokenizer, prefill_step(config), draft_ram),
            )
            if text_alone
            else None
        )
        server = config.server
        self.scheduler = Scheduler(
            loaded.model,
            loaded.tokenizer,
            self.prefix_cache,
            prefill_step(config),
            server.batch_limit(),
            stack.stats,
            StartOrder("fifo") if world is not None else StartOrder(server.scheduling, server.max_wait_s),
            server.prefill_batch_size,
            server.max_queue,
            server.short_prefill_tokens,
            share_prefill_step=config.generation.prefill_step_shared,
            kv_room=self.kv_room,
            speculation=self.speculation,
            vision=self.vision,
            distributed=world is not None,
        )
        if world is None:
            self.worker = InferenceWorker(self.scheduler, config.server.max_queue)
        else:
            self.worker = DistributedWorker(self.scheduler, config.server.max_queue, world, self._execute)
        self.started_at = time.time()
        self.prefetcher: Prefetcher | None = None  # set by start() with [ssd] prefetch_on_start
        # Principals' chain roots ([cache] isolation = "per_key"), the secret beside the SSD blocks.
        manager, lock = self.prefix_cache.manager, self.folder_lock
        folder = lock.folder if lock is not None else None
        self.salts = CacheSalts(folder, manager.hasher.namespace) if manager is not None else None

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
    def model_path(self) -> Path:
        return self.loaded.path

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread-safe to encode and decode with; no MLX)."""
        return self.loaded.tokenizer

    @property
    def cache_enabled(self) -> bool:
        return self.prefix_cache.manager is not None

    @property
    def cache_reason(self) -> str:
        """Why block caching is off ("" while it is on)."""
        return self.prefix_cache.reason

    @property
    def leases_active(self) -> bool:
        """Whether any cache_control lease is held now (then prompts refresh their TTLs)."""
        leases = self.prefix_cache.manager.pins.leases if self.cache_enabled else None
        return leases is not None and leases.active

    @property
    def keeps_checkpoints(self) -> bool:  # hybrid and sliding-window models: states kept at asked positions
        return self.cache_enabled and self.prefix_cache.layout.needs_checkpoints

    def router_view(self) -> RouterView | None:
        """What a router follows of this cache; None while block caching is off."""
        return RouterView(manager) if (manager := self.prefix_cache.manager) is not None else None

    @property
    def is_alive(self) -> bool:  # whether the worker thread runs
        return self.worker.is_alive

    @property
    def failure(self) -> str:
        """Why no request can be served any more ("" while the worker serves; distributed: a rank died)."""
        return getattr(self.worker, "failed", "")

    @property
    def queue_depth(self) -> int:
        return self.worker.queue_depth

    @property
    def is_busy(self) -> bool:
        return self.worker.is_busy

    def ssd_problem(self) -> str:
        """What is wrong with the SSD tier now, in a sentence ("" when it works or is off by config)."""
        if not (self.config.ssd.enabled and self.cache_enabled):
            return ""
        tier = self.prefix_cache.ssd_tier
        if tier is None:
            return "the SSD tier is off: its folder could not be used at startup (see the log)"
        if not tier.writer.is_alive:
            return "the SSD writer thread is not running; new blocks are not saved"
        return ""

    @property
    def context_length(self) -> int:
        """The context served: the model's own, capped by [model] context_length and by the tokens
        the batch's KV budget holds (engine/batch/kv_room.py: [server] kv_batch_bytes, else the memory plan's)."""
        caps = (self.config.model.context_length, self.kv_room.max_tokens if self.kv_room is not None else 0)
        return min([self.loaded.context_length, *(c for c in caps if c)])

    @property
    def vocab_size(self) -> int:
        """How many tokens the model scores: its config's vocab_size (0 when it names none)."""
        config = self.loaded.config
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        return size if isinstance(size, int) and size > 0 else 0

    def start(self) -> None:
        """Set Metal's wired limit to the memory plan's (put back by stop()) and start the worker; with
        [ssd] prefetch_on_start, it reads the hottest chains from the SSD into RAM while no request
        runs (engine/cache/prefetch.py)."""
        if self._wires:
            device_memory.wire(self.memory_plan.wired_limit_bytes)
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
        if self._wires:
            device_memory.unwire()

    def submit(self, req: GenerationRequest) -> None:
        """Queue `req` for the worker (OverloadedError when the queue is full); its prompt's
        block hashes are computed here if the caller has not asked for them yet."""
        manager = self.prefix_cache.manager
        if manager is not None and self.world is None:
            req.cache_root = self.cache_root(req.principal)
            if req.block_hashes is None:
                req.block_hashes = self.block_hashes(req.cache_keys(req.prompt_tokens), req.principal)
        self.worker.submit(req)

    def cache_root(self, principal: str) -> bytes | None:
        """The root of `principal`'s chain (kv/salts.py); None for "" (the plain namespace)."""
        return self.salts.root(principal) if principal and self.salts is not None else None

    def block_hashes(self, tokens: list[int], principal: str = "") -> list[bytes]:
        """The chain of `tokens`' full blocks in this model's cache namespace, or the one
        `principal`'s lookups walk (shared pins first, kv/salts.py); [] when the block cache is
        off. Any thread."""
        manager = self.prefix_cache.manager
        if manager is None:
            return []
        return principal_chain(manager.hasher, tokens, self.cache_root(principal), lambda h: manager.pins.count(h) > 0)

    def prefill(self, tokens: list[int], timeout: float | None = None, principal: str = "") -> None:
        """Run `tokens` through the worker (one generated token, discarded) and block until its KV
        blocks are registered (in `principal`'s chain). Raises the worker's error; OverloadedError
        when the queue is full."""
        done = threading.Event()
        failure: list[Exception] = []

        def emit(event: Any) -> None:
            if isinstance(event, Failed):
                failure.append(event.error)

        req = GenerationRequest(
            f"prefill-{uuid.uuid4().hex[:12]}",
            tokens,
            SamplingParams(max_tokens=1),
            emit,
            on_done=done.set,
            principal=principal,
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
                hashes = self.block_hashes(tokens)
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
        principal: str = "",
    ) -> list[int]:
        """Token ids of `messages` under the model's chat template (by default ready for the
        assistant's turn, exactly as a chat request renders them), with `tools` (OpenAI's shape)
        and `template_kwargs` (e.g. enable_thinking) given to the template. The text is encoded
        through `principal`'s token memo where the tokenizer allows (token_memo.py: same ids)."""
        tokenizer = self.loaded.tokenizer
        return token_memo.chat_tokens(tokenizer, messages, add_generation_prompt, tools, template_kwargs, principal)

    def chat_text(self, messages: list[dict[str, Any]], tools: list | None, template_kwargs: Any) -> str | None:
        """The text chat_tokens (ready for the assistant's turn) encodes through the memo; None without one."""
        return token_memo.chat_text(self.loaded.tokenizer, messages, True, tools, template_kwargs)

    def tokens_within(self, text: str, ids: list[int], chars: int, principal: str = "") -> int | None:
        """How many of `ids`, chat_tokens' for `text`, lie within its first `chars` characters (None: unknown)."""
        memo = token_memo.memo_for(self.loaded.tokenizer)  # None: the template encodes, no memo to ask
        return memo and memo.tokens_within(text, ids, chars, principal)

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
            out["ssd_folder"] = str(tier.store.cache_dir)
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
        scheduler = self.scheduler
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
            "scheduling": scheduler.order.policy,
            "max_wait_s": round(s.max_wait_s, 3),
            "overdue_starts": s.overdue_starts,
            "speculative": self.speculation.describe() if self.speculation is not None else {"mode": "off"},
            "prefilling": [  # long prompts being prefilled now: uncached tokens done of those to do
                {"done": p.done, "total": p.total} for p in scheduler.prefill_progress()
            ],
        }

    def prompt_progress(self, req: GenerationRequest) -> dict[str, int] | None:
        """llama.cpp's `prompt_progress` for `req` while its prompt prefills (None otherwise): the prompt's
        tokens, those the cache supplied, those in the KV so far (cached included), ms since it started."""
        for p in self.scheduler.prefill_progress():
            if p.req is req:
                total, elapsed = len(req.prompt_tokens), time.perf_counter() - p.started
                processed = min(total, p.cached + p.done)
                return {"total": total, "cache": p.cached, "processed": processed, "time_ms": int(elapsed * 1000)}
        return None

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "queue_depth": self.worker.queue_depth,
            "busy": self.worker.is_busy,
            "batch": self.batch_stats(),
            "context_length": self.context_length,
            "memory_plan": self.memory_plan.describe(),
            "cache": self.cache_stats(),
            **({"vision": self.vision.stats()} if self.vision is not None else {}),
        }
