"""The engine: a loaded model, its tokenizer and the worker thread that owns MLX.

The HTTP layer talks only to this class: it tokenizes prompts (thread-safe, no MLX) and submits
GenerationRequests; everything that touches MLX happens on the worker thread.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..config import Config, default_home
from ..kv import blocks
from ..kv.hashing import BlockHasher, model_fingerprint, namespace_hash
from ..kv.manager import KVManager
from ..kv.ram import RAMStore
from ..kv.tails import TailStore
from ..models.loader import LoadedModel
from .generate import Generator
from .prefix_cache import PrefixCache
from .request import GenerationRequest
from .worker import InferenceWorker

log = logging.getLogger(__name__)


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def build_prefix_cache(loaded: LoadedModel, config: Config) -> PrefixCache:
    """The block cache for this model, or a disabled one with the reason (logged once)."""
    if not config.cache.enabled:
        return PrefixCache(loaded.model, None, "disabled by configuration ([cache] enabled = false)")
    support = blocks.cache_support(loaded.model)
    if not support.supported:
        log.warning("block caching is off for this model: %s", support.reason)
        return PrefixCache(loaded.model, None, support.reason)
    fingerprint = model_fingerprint(loaded.path, default_home() / "fingerprints.json")
    namespace = namespace_hash(fingerprint, support.kv_dtype, config.cache.block_size)
    budget = config.cache.ram_max_bytes or physical_memory_bytes() // 4
    # Partial last blocks get an eighth of the RAM budget; full blocks the rest.
    tails = TailStore(budget // 8)
    manager = KVManager(BlockHasher(namespace, config.cache.block_size), RAMStore(budget - tails.max_bytes), tails)
    log.info(
        "block cache on: %d-token blocks, RAM budget %.1f GiB, model %s",
        config.cache.block_size,
        budget / 2**30,
        fingerprint[:12],
    )
    return PrefixCache(loaded.model, manager)


class Engine:
    def __init__(self, loaded: LoadedModel, config: Config):
        self.loaded = loaded
        self.config = config
        self.prefix_cache = build_prefix_cache(loaded, config)
        self.generator = Generator(
            loaded.model, loaded.tokenizer, self.prefix_cache, config.generation.prefill_step_size
        )
        self.worker = InferenceWorker(self.generator, config.server.max_queue)
        self.started_at = time.time()

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    def start(self) -> None:
        self.worker.start()

    def stop(self, timeout: float | None = None) -> None:
        self.worker.stop(timeout)

    def submit(self, req: GenerationRequest) -> None:
        self.worker.submit(req)

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for the assistant turn."""
        return list(self.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def text_tokens(self, prompt: str) -> list[int]:
        return list(self.loaded.tokenizer.encode(prompt))

    def cache_stats(self) -> dict[str, Any]:
        manager = self.prefix_cache.manager
        if manager is None:
            return {"enabled": False, "reason": self.prefix_cache.reason}
        return {"enabled": True, "block_size": manager.block_size, **manager.stats()}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "queue_depth": self.worker.queue_depth,
            "busy": self.worker.is_busy,
            "context_length": self.context_length,
            "cache": self.cache_stats(),
        }
