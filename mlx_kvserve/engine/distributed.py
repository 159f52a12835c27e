"""One model across several processes over MLX's own `mx.distributed` (launched with `mlx.launch`).

Every rank holds a shard of the model (models/sharding.py: tensor or pipeline parallel) and
runs the same batch in lockstep: the model's forward pass contains collectives, so every rank must
admit, cancel and step the same requests in the same order. Rank 0 serves HTTP; at the top of each
worker iteration it shares what changed — new requests, cancellations, cache commands — with the
other ranks (one broadcast), and every rank applies it before the step. Nothing else may make a
rank's batch differ: sampling seeds are fixed by rank 0, and a shared-prefix wait (which depends on
the local cache) is off.

Each rank keeps its own block cache of its own shard. Before a request prefills, the ranks agree on
the cached length (the minimum over ranks), so a block one rank lost costs a shorter hit, never a
wrong answer.
"""

from __future__ import annotations

import logging
import pickle
import queue
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from .cache.admin import CacheAdmin
from .request import Finished, GenerationRequest, Usage
from .worker import _STOP, InferenceWorker

log = logging.getLogger(__name__)

MODES = ("tensor", "pipeline")
IDLE_POLL_S = 0.5  # rank 0 shares an empty update this often while idle (followers wait in it)


class World:
    """This process's place among the ranks: `rank`, `size`, `mode`, and the collectives the
    engine needs (pickled objects; every rank must call each one in the same order)."""

    def __init__(self, group: Any, mode: str):
        if mode not in MODES:
            raise ValueError(f"distributed mode must be one of {', '.join(MODES)}")
        self.group = group
        self.mode = mode
        self.rank = group.rank()
        self.size = group.size()
        # The engine's own collectives (updates, agreements, gathers): count and seconds spent in
        # them, waiting for the other ranks included (plain ints/floats: read by /health).
        self.collectives = 0
        self.collective_s = 0.0

    def _timed(self, fn: Any, *args: Any) -> Any:
        _settle()  # not counted: that is the forward pass finishing, not the collective
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.collectives += 1
            self.collective_s += time.perf_counter() - start

    @property
    def tag(self) -> str:
        """The sharding, for the cache namespace: blocks of one layout are never read under another."""
        return f"{self.mode}/{self.size}"

    def share(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        return self._timed(self._share, obj)

    def _share(self, obj: Any) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = mx.distributed.all_sum(mx.array(len(data)), group=self.group).item()
        # Bytes travel as int32: the ring backend's sums of small-integer types garble data here.
        buf = (
            mx.array(np.frombuffer(data, np.uint8).astype(np.int32)) if self.rank == 0 else mx.zeros((size,), mx.int32)
        )
        out = mx.distributed.all_sum(buf, group=self.group)
        mx.eval(out)  # on rank 0 too: every rank must run every collective, in the same order
        return pickle.loads(np.array(out).astype(np.uint8).tobytes()) if self.rank else obj

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        return self._timed(self._gather, obj)

    def _gather(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        sizes = [int(n) for n in mx.distributed.all_gather(mx.array([len(data)]), group=self.group).tolist()]
        padded = np.zeros((1, max(sizes)), np.int32)
        padded[0, : len(data)] = np.frombuffer(data, np.uint8)
        rows = np.array(mx.distributed.all_gather(mx.array(padded), group=self.group)).astype(np.uint8)
        return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, sizes, strict=True)]

    def all_lengths(self, n: int) -> list[int]:
        """Every rank's `n` (one small collective)."""
        return self._timed(lambda: mx.distributed.all_gather(mx.array([n]), group=self.group).tolist())


def _settle() -> None:
    """Wait for the work MLX still runs asynchronously (the batch evaluates its next step ahead,
    and the model's forward pass holds collectives of its own): a collective of ours issued
    meanwhile would interleave with those in a different order on each rank."""
    from mlx_lm.generate import generation_stream  # the stream the batch runs on

    mx.synchronize(generation_stream)
    mx.synchronize()


@dataclass
class Update:
    """What rank 0 shares before a step."""

    requests: list[tuple[str, list[int], Any, tuple[int, ...]]] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    commands: list[tuple[str, tuple]] = field(default_factory=list)  # (CacheAdmin method or "stats", args)
    stop: bool = False


class _Command:
    def __init__(self, name: str, args: tuple):
        self.name, self.args = name, args
        self.future: Future = Future()


class DistributedWorker(InferenceWorker):
    """The worker of one rank. Rank 0's takes requests from its queue (as InferenceWorker) and
    shares them; the others get everything from rank 0 (`submit` is never called on them).
    `run_command` runs a cache command on every rank (pins must reach every rank's shard) and
    returns rank 0's result; "stats" gathers every rank's cache statistics."""

    def __init__(self, scheduler: Any, max_queue: int, world: World, execute: Any):
        super().__init__(scheduler, max_queue)
        self.world = world
        self._execute = execute  # (name, args) -> result, on this rank
        self._mirrors: dict[str, tuple[GenerationRequest, GenerationRequest]] = {}  # id -> (client's, batch's)
        self._commands: queue.Queue = queue.Queue()
        self._pending: list[_Command] = []  # rank 0: commands shared, waiting for their results
        self.failed: str = ""  # why the worker stopped serving (a collective failed: a rank is gone)

    def run_command(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """Run a cache command on every rank; rank 0's result. TimeoutError when the ranks do
        not answer within `timeout` (a rank is gone or the batch is stuck)."""
        if self.failed:
            raise RuntimeError(self.failed)
        command = _Command(name, args)
        self._commands.put(command)
        return command.future.result(timeout)

    def run_follower(self) -> None:
        """Ranks other than 0: serve rank 0's updates on this thread until it says stop."""
        self._loop()

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a collective failed: another rank died
            self.failed = f"distributed worker stopped: {exc}"
            log.exception("rank %d: %s", self.world.rank, self.failed)
            self._fail_pending()

    def _serve(self) -> None:
        stopping = False
        while True:
            update = self.world.share(self._collect(stopping) if self.world.rank == 0 else None)
            stopping = stopping or update.stop
            self._apply(update)
            busy = self.scheduler.has_work
            if busy:
                self._step()
            elif stopping:
                self.scheduler.close()
                return

    def _collect(self, stopping: bool) -> Update:
        """Rank 0: what to share now. Blocks up to IDLE_POLL_S when nothing runs."""
        update = Update(stop=stopping)
        busy = self.scheduler.has_work
        room = self.scheduler.max_batch - self.scheduler.num_running
        while not stopping and room > 0:
            try:
                item = (
                    self._queue.get(timeout=IDLE_POLL_S)
                    if not busy and not update.requests
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if item is _STOP:
                update.stop = stopping = True
                break
            update.requests.append(self._mirror(item))
            room -= 1
        for key, (client, batch) in self._mirrors.items():
            if (client.cancelled.is_set() or stopping) and not batch.cancelled.is_set():
                update.cancel.append(key)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            update.commands.append((command.name, command.args))
            self._pending.append(command)
        return update

    def _mirror(self, req: GenerationRequest) -> tuple[str, list[int], Any, tuple[int, ...]]:
        """The batch runs a copy of rank 0's request whose cancellation only the shared updates
        set (so every rank cancels it at the same step), with a seed every rank samples with."""
        params = req.params if req.params.seed is not None else replace(req.params, seed=random.getrandbits(31))
        key = f"{req.request_id}#{id(req)}"
        batch = GenerationRequest(req.request_id, list(req.prompt_tokens), params, req.emit, on_done=req.on_done)
        batch.checkpoint_at = req.checkpoint_at
        self._mirrors[key] = (req, batch)
        return key, batch.prompt_tokens, params, req.checkpoint_at

    def _apply(self, update: Update) -> None:
        for key in update.cancel:
            pair = self._mirrors.get(key)
            if pair is not None:
                pair[1].cancel()
        for key, tokens, params, checkpoint_at in update.requests:
            if self.world.rank == 0:
                batch = self._mirrors[key][1]
            else:
                batch = GenerationRequest(key, tokens, params, lambda event: None)
                batch.checkpoint_at = checkpoint_at
                self._mirrors[key] = (batch, batch)
            done = batch.on_done

            def finished(key: str = key, done: Any = done) -> None:
                self._mirrors.pop(key, None)
                if done is not None:
                    done()

            batch.on_done = finished
            self._admit(batch)
        results = [self._run(name, args) for name, args in update.commands]
        if self.world.rank == 0:
            for command, result in zip(self._pending, results, strict=True):
                if isinstance(result, Exception):
                    command.future.set_exception(result)
                else:
                    command.future.set_result(result)
            self._pending.clear()

    def _run(self, name: str, args: tuple) -> Any:
        """A command on this rank; "stats" gathers every rank's (a collective: every rank runs it)."""
        try:
            result = self._execute(name, args)
        except Exception as exc:  # the same error on every rank: rank 0 reports it
            result = exc
        if name == "stats":
            return self.world.gather(result)
        return result

    def _cancel_running(self) -> None:
        """At stop: the clients' requests are cancelled, and through the shared update every
        rank's copies at the same step (the update that carries the stop cancels them all)."""
        for client, _ in list(self._mirrors.values()):
            client.cancel()

    def _admit(self, req: GenerationRequest) -> None:
        """Admit on every rank alike: unlike InferenceWorker, never cancel here at shutdown (only
        rank 0 knows of it; the shared update cancels everything running instead)."""
        on_done = req.on_done

        def done() -> None:
            with self._lock:
                self._running.pop(id(req), None)
            if on_done is not None:
                on_done()

        req.on_done = done
        with self._lock:
            self._running[id(req)] = req
        self.scheduler.admit(req)

    def _fail_pending(self) -> None:
        for command in self._pending:
            if not command.future.done():
                command.future.set_exception(RuntimeError(self.failed))
        for client, _ in list(self._mirrors.values()):
            if client.on_done is not None:
                client.emit(Finished("cancelled", Usage(len(client.prompt_tokens), 0), 0.0))


class BroadcastAdmin(CacheAdmin):
    """CacheAdmin whose changes (pin, unpin, flush, prune) run on every rank through the worker;
    rank 0's answer is returned. Reads stay local to rank 0."""

    def __init__(self, prefix_cache: Any, worker: DistributedWorker, timeout: float = 60.0):
        super().__init__(prefix_cache)
        self._worker = worker
        self._timeout = timeout

    def _everywhere(self, name: str, *args: Any) -> Any:
        return self._worker.run_command(name, *args, timeout=self._timeout)

    def pin(self, hashes: Any, chain: bool = False) -> dict[str, Any]:
        return self._everywhere("pin", list(hashes), chain)

    def unpin(self, hashes: Any, chain: bool = False) -> dict[str, Any]:
        return self._everywhere("unpin", list(hashes), chain)

    def flush(self, *args: Any) -> dict[str, Any]:
        return self._everywhere("flush", *args)

    def prune(self, *args: Any) -> dict[str, Any]:
        return self._everywhere("prune", *args)

    def lease(self, tokens: Any, ttl_s: float, known: Any = ()) -> int:
        return self._everywhere("lease", list(tokens), ttl_s, list(known))

    def touch_leases(self, tokens: Any, known: Any = ()) -> int:
        # Every request calls this: the other ranks hear of it only when rank 0 refreshed a lease.
        refreshed = super().touch_leases(tokens, known)
        if refreshed:
            self._everywhere("touch_leases", list(tokens), list(known))
        return refreshed
