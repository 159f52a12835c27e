"""The SSD tier behind the RAM tier: what KVManager calls when blocks are created, evicted or
missing from RAM. Writes go through the writer thread (never on the caller's lock); reads are
synchronous (the request needs the block now) and verified by the store."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .base import Block
from .ssd import SaveResult, SSDStore
from .ssd_index import block_relpath, read_header
from .ssd_tails import SSDTailStore, tail_key
from .writer import SSDWriterThread, WriteJob

log = logging.getLogger(__name__)

POLICIES = ("write_through", "evict_only")
SHUTDOWN_FILE = "shutdown.json"
PRUNE_INTERVAL_S = 3600.0


class SSDTier:
    """`to_arrays(payload)` / `from_arrays(arrays) -> (payload, nbytes)` convert block payloads to
    the store's named arrays; only the engine knows their layout."""

    def __init__(
        self,
        store: SSDStore,
        writer: SSDWriterThread,
        policy: str,
        to_arrays: Callable[[Any], dict],
        from_arrays: Callable[[dict], tuple[Any, int]],
        flush_interval_s: float = 2.0,
        async_writes: bool = True,
        write_hold_s: float = 0.0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.store = store
        self.writer = writer
        self.policy = policy
        self._to_arrays = to_arrays
        self._from_arrays = from_arrays
        self.flush_interval_s = flush_interval_s
        self.async_writes = async_writes
        self.write_hold_s = write_hold_s
        self._last_prune = time.time()
        self.last_shutdown = read_shutdown_record(store.cache_dir)
        self.validation: dict[str, Any] = {}  # the startup validate_index report
        self.tails = SSDTailStore(store.cache_dir / "tails", store.namespace)
        self._tail_lock = threading.Lock()  # guards _tail_keys
        self._tail_keys: set[bytes] = set()  # writer jobs that are tails, not blocks

    def _write(self, block: Block) -> None:
        job = WriteJob(block.block_hash, block.parent_hash, block.token_ids, self._to_arrays(block.payload))
        if self.async_writes:
            self.writer.enqueue(job)
        else:
            self.store.save_block(*job)

    def hold_writes(self) -> None:
        """A request is prefilling: background writes wait until `resume_writes`, at most
        write_hold_s (its first token is what the user waits for; the writes can wait)."""
        self.writer.hold(self.write_hold_s)

    def resume_writes(self) -> None:
        self.writer.resume()

    def on_new_block(self, block: Block) -> None:
        if self.policy == "write_through":
            self._write(block)

    def on_evicted(self, blocks: list[Block]) -> None:
        if self.policy == "evict_only":
            for block in blocks:
                if not self.store.contains(block.block_hash):
                    self._write(block)

    def persist_resident(self, blocks: list[Block]) -> int:
        """At shutdown: under evict_only, hand the RAM blocks the SSD lacks to the writer (most
        recently used first), so a clean restart finds them. Returns how many were queued."""
        return self.persist(blocks[::-1]) if self.policy == "evict_only" else 0

    def persist(self, blocks: list[Block]) -> int:
        """Write the given blocks the SSD lacks, whatever the policy (pinned blocks: so they can be
        demoted instead of held in RAM beyond the pinned share). Returns how many were queued."""
        queued = 0
        for block in blocks:
            if not self.store.contains(block.block_hash):
                self._write(block)
                queued += 1
        return queued

    def load(self, block_hash: bytes, token_ids: Sequence[int]) -> tuple[Any, int] | None:
        """(payload, nbytes) of a verified block on the SSD, or None."""
        loaded = self.store.load_block(block_hash, token_ids)
        if loaded is None:
            return None
        try:
            return self._from_arrays(loaded.arrays)
        except (KeyError, ValueError) as exc:
            log.warning("SSD block %s has an unexpected layout (%s); ignored", block_hash.hex()[:16], exc)
            return None

    def save_tail(self, parent_hash: bytes, token_ids: Sequence[int], payload: Any) -> None:
        """Persist a tail, through the writer thread like blocks (off the request path)."""
        arrays = self._to_arrays(payload)
        if not self.async_writes:
            self.tails.save(parent_hash, token_ids, arrays)
            return
        key = tail_key(parent_hash, token_ids)
        with self._tail_lock:
            self._tail_keys.add(key)
        if not self.writer.enqueue(WriteJob(key, parent_hash, tuple(token_ids), arrays)):
            with self._tail_lock:
                self._tail_keys.discard(key)

    def save_job(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int], arrays: dict) -> SaveResult:
        """The writer's save function: a tail job (its key was registered by save_tail) or a block."""
        with self._tail_lock:
            is_tail = block_hash in self._tail_keys
            self._tail_keys.discard(block_hash)
        if is_tail:
            return SaveResult.SAVED if self.tails.save(parent_hash, token_ids, arrays) else SaveResult.SKIPPED
        return self.store.save_block(block_hash, parent_hash, token_ids, arrays)

    def load_tail(self, parent_hash: bytes, rest: Sequence[int]) -> tuple[tuple[int, ...], Any, int, int] | None:
        """(token ids, payload, nbytes, tokens shared with `rest`) of the best stored tail, or None."""
        loaded = self.tails.best(parent_hash, rest)
        if loaded is None:
            return None
        try:
            payload, nbytes = self._from_arrays(loaded.arrays)
        except (KeyError, ValueError):
            return None
        return loaded.token_ids, payload, nbytes, loaded.num_shared

    def contains(self, block_hash: bytes) -> bool:
        return self.store.contains(block_hash)

    def parent_of(self, block_hash: bytes) -> bytes | None:
        """The parent hash recorded in the block's file header, or None when it is not stored."""
        if not self.store.contains(block_hash):
            return None
        try:
            return read_header(self.store.cache_dir / block_relpath(block_hash), self.store.namespace).parent_hash
        except (OSError, ValueError):
            return None

    def after_write(self) -> None:
        """Upkeep on the writer thread, after each write and while idle: batched index flushes
        (loads mark the index dirty too) and TTL pruning by wall time."""
        self.store.maybe_flush(self.flush_interval_s)
        self.maybe_prune()

    def maybe_prune(self) -> int:
        """TTL pruning at most once per PRUNE_INTERVAL_S of wall time. Called on the writer thread
        after each write and every minute while idle. Returns the blocks pruned."""
        if time.time() - self._last_prune < PRUNE_INTERVAL_S:
            return 0
        self._last_prune = time.time()
        self.tails.prune(self.store.ttl_s)
        return self.store.prune_expired()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ssd_policy": self.policy}
        out.update(self.store.stats())
        out.update(self.writer.stats())
        out.update(self.tails.stats)
        return out

    def close(self, drain_timeout_s: float) -> bool:
        """Drain the writer, flush the index and record how the shutdown went. True when clean."""
        drained = self.writer.stop(drain_timeout_s)
        flushed = True
        try:
            self.store.flush()
        except OSError as exc:
            log.error("SSD index flush failed at shutdown: %s", exc)
            flushed = False
        clean = bool(drained and flushed)
        write_shutdown_record(self.store.cache_dir, clean, partial_flush=not drained)
        log.info("SSD tier closed: shutdown_clean=%s", clean)
        return clean


def write_shutdown_record(cache_dir: Path, clean: bool, partial_flush: bool) -> None:
    record = {"shutdown_clean": clean, "shutdown_partial_flush": partial_flush, "at": time.time()}
    tmp = cache_dir / f".{SHUTDOWN_FILE}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, cache_dir / SHUTDOWN_FILE)
    except OSError as exc:  # e.g. a full disk: the next start then reports an unclean shutdown
        log.error("cannot record the shutdown in %s: %s", cache_dir, exc)


def read_shutdown_record(cache_dir: Path) -> dict[str, Any]:
    """How the previous run ended. A missing record after a previous run means it crashed; the
    record is removed on reading so a crash of this run is visible to the next one."""
    path = cache_dir / SHUTDOWN_FILE
    try:
        record = json.loads(path.read_text())
        path.unlink()
        return record
    except FileNotFoundError:
        return {"shutdown_clean": None, "shutdown_partial_flush": None}
    except (OSError, ValueError):
        return {"shutdown_clean": False, "shutdown_partial_flush": None}
