"""Continuous batching on mlx-lm's BatchGenerator, over the block cache. Runs on the worker thread.

A request joins between steps: its cached prefix is assembled (PrefixCache.prepare: RAM, SSD,
tails) and handed to the batch as its starting cache, with the uncached rest of the prompt to
prefill. Each `step` runs one decode step for the running requests and one prefill chunk
(`prefill_step_size` tokens) for the joining ones, so a long prompt never stalls the others for
more than a chunk; a short rest joins decoding directly with its first token (direct_join.py).
A request leaves at eos, max_tokens, a stop string or cancellation; its sequence's KV is then
extracted from the batch cache and registered as blocks. Its prompt's blocks are registered
earlier, right after its first token, so requests arriving later reuse them.

One class, one file: each request is one `Run` (state.py) whose `phase` the Scheduler moves on
(pending -> waiting for a shared prefix -> prefilling -> decoding, or solo on the speculative path);
the paths a request may take outside mlx-lm's batch (a direct join, a side prefill, the speculative
path) are methods here, their pure parts in direct_join.py, side_prefill.py and engine/speculative/.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences

from ...kv.blocks import shift_positions
from ..cache.prefix_cache import PrefixCache, Prepared
from ..memory.device import release_after_out_of_memory
from ..request import Failed, Finished, GenerationRequest, Usage
from ..sampling.constrain import grammars_for
from ..sampling.sampler import RequestFault, make_request_processors, make_request_sampler, repair_random_state
from ..speculative.acceptance import resumed_sampler
from ..speculative.speculator import Speculator
from . import direct_join, side_prefill
from .kv_room import KvRoom
from .mlx_batch import KVServeBatchGenerator
from .order import StartOrder
from .prefix_waits import pick_leader, shared_blocks
from .state import Phase, PrefillProgress, Run, SchedulerStats, prefill_progress
from .stops import StopMatcher

log = logging.getLogger(__name__)


class Scheduler:
    """Runs any number of requests together, at most `max_batch` decoding at once.

    `admit` never raises: a request that cannot start gets a Failed event. `step` advances every
    request by one token (or one prefill chunk); a request that fails alone (its sampler, its
    logits processors, its emit, its block registration) gets Failed and leaves while the others
    go on; an error of the batch's forward pass fails every request in the batch (none can be told
    apart) and the batch starts afresh.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prefix_cache: PrefixCache,
        prefill_step_size: int = 512,
        max_batch: int = 8,
        stats: SchedulerStats | None = None,
        order: StartOrder | None = None,
        prefill_batch_size: int = 0,
        max_pending: int = 0,
        short_prefill_tokens: int = 0,
        *,
        share_prefill_step: bool = True,
        kv_room: KvRoom | None = None,
        speculation: Speculator | None = None,
        vision: Any = None,
        distributed: bool = False,
    ):
        """`kv_room`: pending requests start only while their KV fits (engine/batch/kv_room.py; None: no
        bound). `speculation`: a request that runs alone decodes by drafts (engine/speculative/).
        `vision`: a vision-language model's images (vision/runtime.py). `distributed`: every rank runs
        this batch in lockstep (engine/distributed.py), so nothing rank-local may change its passes: no
        shared-prefix waits, direct joins or side prefills."""
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.prefill_step_size = prefill_step_size
        self.max_batch = max_batch
        # Requests admitted and not yet started wait here (at most max_pending; 0 = max_batch)
        # until a prefill slot frees up; `order` picks which one starts next.
        self.max_pending = max_pending or max_batch
        self.order = order or StartOrder()
        # Recurrent layers prefill one prompt at a time: mlx-lm right-pads prompts of different
        # lengths prefilled together, and some of its recurrent layers (nemotron_h's in 0.32.2)
        # let the padding into their state. Decoding stays batched.
        # Otherwise up to prefill_batch_size long prompts prefill together (0 = 1: one at a time, in
        # the order's choice, so the first finishes first instead of all together at the end), and
        # short ones (an uncached rest of at most short_prefill_tokens; 0 = a quarter chunk) join
        # beyond that: see _start_pending.
        self.short_joins = not prefix_cache.layout.has_state
        self.prefill_batch_size = 1 if not self.short_joins else min(prefill_batch_size or 1, max_batch)
        self.short_prefill_tokens = short_prefill_tokens or max(1, prefill_step_size // 4)
        self.direct_join_budget = prefill_step_size  # tokens left this step for direct joins (direct_join.py)
        self.stats = stats if stats is not None else SchedulerStats()
        self.share_prefill_step = share_prefill_step  # prompts prefilling together share a step (mlx_batch.py)
        self.kv_room = kv_room
        self.speculation = speculation
        self.vision = vision
        self.distributed = distributed
        self._eos = StopSequences([[t] for t in tokenizer.eos_token_ids])
        self._batch: KVServeBatchGenerator | None = None
        # Each request's Run sits in the one of these that its phase names.
        self._pending: list[Run] = []  # PENDING, in arrival order
        self._waiting: list[Run] = []  # WAITING for a leader's prompt blocks
        self._running: dict[int, Run] = {}  # PREFILLING, DECODING or SOLO, by BatchGenerator uid
        self._arrivals = 0

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished (pending, in the batch, or waiting for a shared prefix)."""
        return len(self._running) + len(self._waiting) + len(self._pending)

    @property
    def num_started(self) -> int:
        """Requests in the batch or waiting there for a shared prefix."""
        return len(self._running) + len(self._waiting)

    @property
    def num_pending(self) -> int:
        """Requests admitted, waiting for their turn to start. Read from any thread."""
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._pending)

    @property
    def batch_size(self) -> int:
        """Requests in mlx-lm's batch now (prefilling or decoding; not those waiting for a shared prefix)."""
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        return sum(1 for r in self._running.values() if not r.prefill_done)

    def prefill_progress(self) -> list[PrefillProgress]:  # each prompt prefilling now; any thread
        return prefill_progress(self._batch.prefill_progress, self._running) if self._batch is not None else []

    def is_running(self, req: GenerationRequest) -> bool:
        """Whether `req` is admitted and not finished (pending, waiting or in the batch)."""
        return (
            any(r.req is req for r in self._running.values())
            or any(w.req is req for w in self._waiting)
            or any(p.req is req for p in self._pending)
        )

    @property
    def is_full(self) -> bool:
        """No room for another admitted request (the worker keeps it in its queue)."""
        return len(self._pending) >= self.max_pending

    def _generator(self) -> KVServeBatchGenerator:
        if self._batch is None:
            self._batch = KVServeBatchGenerator(
                self.model,
                completion_batch_size=self.max_batch,
                prefill_batch_size=self.max_batch if self.short_joins else self.prefill_batch_size,
                prefill_step_size=self.prefill_step_size,
            )
            self._batch.share_step = self.share_prefill_step
            self._batch.on_first_tokens = self._send_ahead
        return self._batch

    def admit(self, req: GenerationRequest) -> None:
        """Take `req`: it starts at a later step, when a prefill slot is free and `order` picks
        it (never raises: a request that cannot start gets a Failed event)."""
        self._arrivals += 1
        self._pending.append(Run(req, time.perf_counter(), self._arrivals))

    def run(self, req: GenerationRequest) -> None:
        """Generate for `req` alone, sending TextDelta events and one Finished (or Failed) event
        through req.emit, and register its KV blocks; returns when all of that is done. Only for
        callers on the thread that owns MLX while the worker is not serving (tests, tools)."""
        self.admit(req)
        while self.is_running(req):
            self.step()

    def _start_pending(self) -> None:
        """Start pending requests, in the order's choice, while the batch has room: up to
        prefill_batch_size prefilling at once and, past that, short ones (an uncached rest of at most
        short_prefill_tokens: a later turn of a conversation), so that a cached turn never waits for
        a round of cold prompts to finish their prefill (at 16 clients it waited 37-43 s behind the
        second round where mlx_lm.server's took 5 s: docs/benchmarks-history-2026-12-07.md). A cold prompt is not
        short even when it fits one chunk: joining, it would slow every prompt prefilling with it
        (their chunks run as one batch) and all of them would get their first token at the end."""
        while self._pending and self.num_started < self.max_batch:
            candidates = self._pending
            if self.num_prefilling >= self.prefill_batch_size:
                if not self.short_joins:
                    return
                short = self.short_prefill_tokens
                candidates = [p for p in self._pending if self.prefix_cache.uncached_tokens(p.req) <= short]
                if not candidates:
                    return
            now = time.perf_counter()
            pick = self.order.pick(candidates, self.prefix_cache.uncached_tokens, now)
            held = (r.req for r in [*self._running.values(), *self._waiting])
            if self.kv_room is not None and not pick.req.cancelled.is_set() and not self.kv_room.fits(pick.req, held):
                return  # its KV would not fit beside the batch's (engine/batch/kv_room.py): nothing starts past it
            self._pending.remove(pick)
            self.order.passed(self._pending, pick, now)
            self.stats.max_wait_s = max(self.stats.max_wait_s, now - pick.started)
            self.stats.overdue_starts += self.order.overdue(pick, now)
            self._begin(pick)

    def _begin(self, run: Run) -> None:
        """Assemble the request's cached prefix and put it in the batch (it prefills from the next
        step). When a request in the batch is prefilling more of its prompt than the cache holds, it
        waits (WAITING) until that request's prompt blocks are registered, then looks up again."""
        req = run.req
        if req.cancelled.is_set():
            self._emit_end(req, Finished("cancelled", Usage(len(req.prompt_tokens), 0), 0.0))
            return
        cache = self.prefix_cache
        if cache.enabled and not self.distributed:  # distributed: no waits (the cache is rank-local)
            try:
                hashes = cache.lookup_hashes(req)
                self._share_direct(hashes)
                prefilling = {
                    u: cache.lookup_hashes(r.req) for u, r in self._running.items() if not r.prompt_registered
                }
                leader = pick_leader(hashes, prefilling, cache.cached_in_ram(hashes)) if prefilling else None
            except Exception as exc:
                self._emit_end(req, Failed(exc))
                return
            if leader is not None:
                run.phase, run.leader = Phase.WAITING, leader
                self._waiting.append(run)
                self.stats.shared_prefix_waits += 1
                return
        self._start(run)

    def _share_direct(self, hashes: list[bytes]) -> None:
        """Blocks a running request read straight into its cache (kv/runs.py, a direct run) join RAM
        now when a new request shares them: else it would read them again and miss that request's
        newer blocks, which RAM holds after them."""
        for other in self._running.values():
            prepared = other.prepared
            if prepared is not None and prepared.match.direct and not prepared.direct_done:
                if shared_blocks(hashes, self.prefix_cache.lookup_hashes(other.req)) > len(prepared.match.blocks):
                    self.prefix_cache.register_direct(prepared)

    def _start(self, run: Run) -> None:
        req = run.req
        try:
            prepared = self.prefix_cache.prepare(req.cache_keys(req.prompt_tokens), req.block_hashes, req.cache_root)
        except Exception as exc:
            self._emit_end(req, Failed(exc))
            return
        try:
            cached = prepared.match.num_tokens
            params = req.params
            points = self.prefix_cache.checkpoints(req.prompt_tokens, cached, req.checkpoint_at)
            # A short rest: its first token from its own prefill (direct_join.py).
            plain = self.short_joins and not points and not req.images and not self.distributed and self.vision is None
            room = min(self.short_prefill_tokens, self.direct_join_budget)
            direct = direct_join.fits(len(req.prompt_tokens) - cached, room, plain)
            first = None
            if not direct:
                cached, points = self._prefill_rest(req, prepared, cached, points)  # images, a short rest
            if self.vision is not None and (delta := self.vision.rope_delta(req.images)) is not None:
                shift_positions(prepared.prompt_cache, delta)  # M-RoPE: tokens after an image (vision/qwen.py)
            fault = RequestFault()
            processors = make_request_processors(params)
            if params.constrained:
                processors.append(grammars_for(self.tokenizer).processor(params.json_schema, params.grammar))
            sampler, processors = fault.sampler(make_request_sampler(params)), [fault.processor(p) for p in processors]
            if direct:
                uid, first = self._join_directly(req, prepared.prompt_cache, cached, sampler, processors)
            else:
                (uid,) = self._generator().insert_segments(
                    [_segments(req.prompt_tokens, cached, points)],
                    max_tokens=[params.max_tokens],
                    caches=[prepared.prompt_cache],
                    all_tokens=[list(req.prompt_tokens[:cached])],
                    samplers=[sampler],
                    logits_processors=[processors] if processors else None,
                    stop_sequences=[self._eos],
                )
        except Exception as exc:
            self.prefix_cache.release(prepared)
            self._emit_end(req, Failed(exc))
            return
        detok = self.tokenizer.detokenizer
        detok.reset()
        run.uid, run.prepared, run.detok, run.stops = uid, prepared, detok, StopMatcher(params.stop)
        run.checkpoints, run.fault = set(points), fault
        run.phase = Phase.DECODING if direct else Phase.PREFILLING
        self._running[uid] = run
        if direct:  # its first token to the client now, before the batch's decode pass reports it
            self._send_ahead([uid], [int(first[0].item())], [first[1][0]])

    def _prefill_rest(self, req: GenerationRequest, prepared: Prepared, cached: int, points: list[int]):
        """Prefill what of `req`'s prompt goes outside the batch (side_prefill.py: images, a short rest
        beside a long prefill); returns the position its cache has reached and the checkpoints still ahead."""
        cache = prepared.prompt_cache
        if req.images and self.vision is not None and self.vision.needs_prefill(req.images, cached):
            step, capture = (
                self.prefill_step_size,
                lambda position: self.prefix_cache.capture(prepared, cache, position),
            )
            reached = self._timed_prefill(
                cached,
                lambda: self.vision.prefill(
                    self.model, cache, req.prompt_tokens, req.images, cached, step, points, capture
                ),
            )
            return reached, [p for p in points if p > reached]
        short = self.short_prefill_tokens
        long_prefilling = any(
            not r.prefill_done and len(r.req.prompt_tokens) - r.prepared.match.num_tokens > short
            for r in self._running.values()
        )
        plain = self.short_joins and not points and not req.images and not self.distributed
        if side_prefill.short_beside_long(len(req.prompt_tokens) - 1 - cached, short, long_prefilling, plain):
            tokens = req.prompt_tokens
            return self._timed_prefill(
                cached, lambda: side_prefill.prefill_alone(self.model, cache, tokens, cached)
            ), points
        return cached, points

    def _timed_prefill(self, cached: int, prefill: Callable[[], int]) -> int:
        """Run a prefill outside the batch, counting its tokens and time in the stats."""
        started = time.perf_counter()
        reached = prefill()
        self.stats.prefill_tokens += reached - cached
        self.stats.prefill_s += time.perf_counter() - started
        return reached

    def _join_directly(
        self, req: GenerationRequest, cache: list[Any], cached: int, sampler: Any, processors: list[Any]
    ):
        """Prefill `req`'s rest (last token included) on `cache`, sample its first token and put it in
        the decode batch (direct_join.py); returns its uid and (first token [1], its log-probabilities [1, V])."""
        started = time.perf_counter()
        tokens, batch = req.prompt_tokens, self._generator()
        token, logprobs = direct_join.first_token(
            self.model, cache, tokens, cached, sampler or batch.sampler, processors
        )
        rest = len(tokens) - cached
        self.direct_join_budget -= rest
        if (
            rest > 1
        ):  # counted as the batch counts a prompt: all but its last token (a one-token pass is no prefill speed)
            self.stats.prefill_tokens += rest - 1
            self.stats.prefill_s += time.perf_counter() - started
        uid = batch.insert_decoding(
            cache, tokens, token, logprobs, req.params.max_tokens, sampler, processors, self._eos
        )
        return uid, (token, logprobs)

    def _send_ahead(self, uids: list[int], tokens: list[int], logprobs: list[mx.array]) -> None:
        """Send first tokens to their clients as soon as they are sampled, before the decode pass that
        reports them: a direct join's, and those of prompts the batch just moved to decoding
        (mlx_batch.py `on_first_tokens`). The pass reports each again (`Run.sent_ahead`: the request
        then only ends if it must: a stop string, max_tokens, a cancel). An eos is left to that report
        (it ends the request, no text). `logprobs`: one [V] row per token."""
        for uid, token, row in zip(uids, tokens, logprobs, strict=True):
            run = self._running.get(uid)
            if run is not None and token not in self.tokenizer.eos_token_ids:
                self._guard(run, self._send_first, run, token, row)

    def _send_first(self, run: Run, token: int, logprobs: mx.array) -> None:
        self._first_token(run, token)
        run.send(token, logprobs)
        run.sent_ahead = True

    def _start_waiting(self) -> None:
        """Start the waiting requests whose leader registered its prompt's blocks (or left)."""
        waiting, self._waiting = self._waiting, []
        for run in waiting:
            leader = self._running.get(run.leader)
            if run.req.cancelled.is_set():
                self._emit_end(run.req, Finished("cancelled", Usage(len(run.req.prompt_tokens), 0), 0.0))
            elif leader is None or leader.prompt_registered:
                self._start(run)
            else:
                self._waiting.append(run)

    def cancel_all(self) -> None:
        for run in [*self._running.values(), *self._waiting, *self._pending]:
            run.req.cancel()

    def step(self) -> None:
        """One decode step for the running requests and one prefill chunk for the joining ones;
        then cancelled requests leave (their KV is registered)."""
        if self.speculation is not None and self._speculate():
            return
        self.direct_join_budget = self.prefill_step_size
        if self._waiting:
            self._start_waiting()
        if self._pending:
            self._start_pending()
        if not self._running:
            return
        batch = self._generator()
        try:
            with batch.stats() as counted:
                prompt_responses, responses = batch.next()
        except Exception as exc:
            log.exception("batch step failed; failing its %d requests", len(self._running))
            self._fail_all(exc)
            return
        stats = self.stats
        stats.steps += 1
        stats.prefill_tokens += counted.prompt_tokens
        stats.prefill_s += counted.prompt_time
        stats.decode_tokens += counted.generation_tokens
        stats.decode_s += counted.decode_time
        for r in prompt_responses:
            run = self._running.get(r.uid)
            if run is None:
                continue
            if r.end_of_prompt:
                run.phase = Phase.DECODING
            elif r.end_of_segment and run.checkpoints:
                self._guard(run, self._capture, run, r.progress[0])
        for r in responses:
            run = self._running.get(r.uid)
            if run is not None:
                self._guard(run, self._on_token, run, r)
        for run in list(self._running.values()):
            if run.fault.error is not None:  # its sampler or processors failed in this step
                log.error("request %s failed", run.req.request_id, exc_info=run.fault.error)
                self._drop(run, run.fault.error)
            elif run.req.cancelled.is_set():
                self._guard(run, self._end, run, "cancelled")
            elif run.prefill_done and run.generated and not run.prompt_registered:
                self._guard(run, self._register_prompt, run)

    def _speculate(self) -> bool:
        """Decode a request that runs alone on the speculative path (engine/speculative/speculator.py):
        one verify pass, True when it ran (the batch does not step). A request alone in the batch, its
        first token out, leaves mlx-lm's batch for it (SOLO) and decodes by drafts verified k at a time
        on its own cache; it goes back as soon as another request is admitted (`_rejoin`)."""
        spec = self.speculation
        assert spec is not None
        alone = len(self._running) == 1 and not self._waiting and not self._pending
        if spec.solo is None:
            run = next(iter(self._running.values())) if alone else None
            if run is None or not (run.prompt_registered and run.generated and spec.wants(run.req.params)):
                return False
            cache, tokens = self._generator().remove([run.uid], return_prompt_caches=True)[run.uid]
            params, prompt_len = run.req.params, len(run.req.prompt_tokens)
            root = run.req.cache_root  # the draft's block cache is salted per principal too
            self._guard(run, spec.begin, run, cache, list(tokens), len(run.generated), params, prompt_len, root)
            if spec.solo is None:  # it failed
                return True
            run.phase = Phase.SOLO
        else:
            run = spec.solo.key
            if not alone:
                self._guard(run, self._rejoin, run)
                return False
        if run.req.cancelled.is_set():
            self._guard(run, self._end, run, "cancelled")
        elif spec.solo is not None:
            start = time.perf_counter()
            try:
                tokens = spec.step()
            except Exception as exc:
                log.exception("request %s failed on the speculative path", run.req.request_id)
                tokens = []
                self._drop(run, exc)
            self.stats.decode_tokens += len(tokens)
            self.stats.decode_s += time.perf_counter() - start
            for token in tokens:
                if self._running.get(run.uid) is not run:
                    break
                self._guard(run, self._on_token, run, token)
        if spec.solo is not None and self._running.get(run.uid) is not run:  # it failed
            spec.end(failed=True)
        return True

    def _rejoin(self, run: Run) -> None:
        """Put the request decoding alone back into the batch, where its last token goes next (a
        seeded sampler resumes its key chain at the next position)."""
        assert self.speculation is not None
        solo = self.speculation.end()
        run.phase = Phase.DECODING
        self.speculation.stats.rejoins += 1
        params = run.req.params
        (uid,) = self._generator().insert_segments(
            [[solo.seq[-1:]]],
            max_tokens=[params.max_tokens - solo.num_generated],
            samplers=[run.fault.sampler(resumed_sampler(params, solo.num_generated))],
            logits_processors=[[run.fault.processor(solo.grammar.processor())]] if solo.grammar is not None else None,
            caches=[solo.cache],
            all_tokens=[solo.kv_tokens],
            stop_sequences=[self._eos],
        )
        del self._running[run.uid]
        run.uid = uid
        self._running[uid] = run

    def _guard(self, run: Run, fn: Any, *args: Any) -> None:
        """Call fn; an exception fails this request alone."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("request %s failed", run.req.request_id)
            self._drop(run, exc)

    def _on_token(self, run: Run, r: Any) -> None:
        token, req = r.token, run.req
        ahead, run.sent_ahead = run.sent_ahead, False  # its first token, sent when sampled (never an eos)
        if not ahead:
            self._first_token(run, token)
        if req.cancelled.is_set():
            return self._end(run, "cancelled", r)
        if r.finish_reason == "stop":  # eos: its text is not sent, the token counts in usage
            run.ended_by_eos = True
            return self._end(run, "stop", r)
        if not ahead:
            run.send(token, r.logprobs)
        if run.stops.stopped:
            return self._end(run, "stop", r)
        if r.finish_reason == "length":
            return self._end(run, "length", r)
        return None

    def _first_token(self, run: Run, token: int) -> None:
        if run.record(token):
            self.prefix_cache.mark_first_token(run.prepared)

    def _take_cache(self, run: Run, r: Any = None) -> tuple[list[Any], list[int]]:
        """The request's (cache, tokens whose KV it holds), taking it out of the batch."""
        if run.phase is Phase.SOLO:  # decoding alone
            solo = self.speculation.end()
            return solo.cache, solo.kv_tokens
        if r is not None and r.finish_reason is not None:  # the batch already let it go
            return r.prompt_cache, list(r.all_tokens)
        caches = self._generator().remove([run.uid], return_prompt_caches=True)
        cache, tokens = caches[run.uid]
        return cache, list(tokens)

    def _end(self, run: Run, reason: str, r: Any = None) -> None:
        """Finish the request: send the held-back text, register its KV, then send Finished, so a
        client that has its whole reply finds its blocks cached (a flush or a repeat sent right
        after it sees them). Never raises: the client may be gone, the KV is still worth keeping."""
        cache, kv_tokens = self._take_cache(run, r)
        del self._running[run.uid]
        req = run.req
        try:
            if not run.stops.stopped and reason != "cancelled":
                run.send_rest()
        except Exception:
            log.exception("request %s: its last text could not be sent", req.request_id)
        try:  # registers the new blocks and releases the request's references
            run.prepared.prompt_cache = cache
            self.prefix_cache.finish(run.prepared, req.cache_keys(kv_tokens), len(req.prompt_tokens))
        except Exception:
            log.exception("request %s: its KV blocks could not be registered", req.request_id)
        run.prepared.prompt_cache = []  # its KV is in blocks now: the batch's arrays may go
        try:
            generated = run.num_generated + run.ended_by_eos
            usage = Usage(len(req.prompt_tokens), generated, run.prepared.match.num_tokens)
            completion = tuple(run.generated[: run.num_generated])
            req.emit(Finished(reason, usage, run.first_token_s, completion))
        except Exception:
            log.exception("request %s: its Finished event could not be sent", req.request_id)
        finally:
            if req.on_done is not None:
                req.on_done()

    def _capture(self, run: Run, done: int) -> None:
        """A segment of the prompt ended: keep a checkpoint there if one was planned."""
        position = run.prepared.match.num_tokens + done
        if position in run.checkpoints:
            cache, _ = self._generator().extract_cache([run.uid])[run.uid]
            self.prefix_cache.capture(run.prepared, cache, position)

    def _register_prompt(self, run: Run) -> None:
        """The prompt's blocks, as soon as its prefill is done (after its first token was sent,
        so this costs the first token nothing), for requests that share the prefix."""
        run.prompt_registered = True
        if not self.prefix_cache.enabled:
            return
        prompt_len = len(run.req.prompt_tokens)
        try:
            cache, tokens = self._generator().extract_cache([run.uid])[run.uid]
            run.prepared.prompt_cache = cache
            keys = run.req.cache_keys(list(tokens))
            # Blocks it read straight into its cache join RAM now when other requests are about (they may
            # share them): as views, whose sharing makes the batch's next write copy its cache; a request
            # alone registers them when it ends, without a copy.
            if self._waiting or self._pending or len(self._running) > 1:
                self.prefix_cache.register_direct(run.prepared)
            self.prefix_cache.register(run.prepared, keys, prompt_len, write=False, upto=prompt_len)
        except Exception:  # the request goes on; its blocks are registered again when it ends
            log.exception("request %s: its prompt's blocks could not be registered", run.req.request_id)
        finally:  # views of the batch's arrays: held on, the batch's next write would copy them whole
            run.prepared.prompt_cache = []

    def _drop(self, run: Run, exc: Exception) -> None:
        """Take a failed request out of the batch without registering anything."""
        if self._running.pop(run.uid, None) is not None:
            try:
                self._generator().remove([run.uid])
            except Exception:
                log.exception("could not remove request %s from the batch", run.req.request_id)
        self.prefix_cache.release(run.prepared)
        self._emit_end(run.req, Failed(exc))

    def _fail_all(self, exc: Exception) -> None:
        running, self._running = list(self._running.values()), {}
        self.close()
        repair_random_state()  # the step may have failed inside a compiled sampler
        for run in running:
            self.prefix_cache.release(run.prepared)
            self._emit_end(run.req, Failed(exc))

    @staticmethod
    def _emit_end(req: GenerationRequest, event: Finished | Failed) -> None:
        if isinstance(event, Failed):  # out of memory: hand MLX's cached buffers back for the next step
            release_after_out_of_memory(event.error)
        try:
            req.emit(event)
        except Exception:
            log.exception("request %s: its final event could not be sent", req.request_id)
        finally:
            if req.on_done is not None:
                req.on_done()

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None


def _segments(prompt: list[int], cached: int, points: list[int]) -> list[list[int]]:
    """prompt[cached:] cut at the given absolute positions (each cached < p < len(prompt)), so
    the batch's prefill stops at each of them (mlx-lm's segmented prompt processing)."""
    cuts = [cached, *points, len(prompt)]
    return [list(prompt[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
