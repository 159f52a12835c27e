"""What the scheduler keeps per request (one `Run`, its `phase` telling where it is) and its counters.
Plain data: engine/batch/scheduler.py changes it (Run.send is the one thing a request does: a token's
text to its client)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from ..cache.prefix_cache import Prepared
from ..request import GenerationRequest, TextDelta
from ..sampling.sampler import RequestFault, token_logprobs
from .stops import StopMatcher


class Phase(Enum):
    """Where a request is in the scheduler (engine/batch/scheduler.py moves it on)."""

    PENDING = "pending"  # admitted, waiting for its turn to start (engine/batch/order.py picks)
    WAITING = "waiting"  # started, waiting for another request's prompt blocks (engine/batch/prefix_waits.py)
    PREFILLING = "prefilling"  # in mlx-lm's batch, its prompt not all in the batch cache yet
    DECODING = "decoding"  # in mlx-lm's batch, generating
    SOLO = "solo"  # out of the batch, decoding alone on the speculative path (engine/speculative/)


@dataclass(eq=False)
class Run:
    """One request in the scheduler, from admission to its end (owned by the scheduler). The fields
    below `phase` are set when it starts (PENDING and WAITING have none of them yet)."""

    req: GenerationRequest
    started: float  # when it reached the scheduler (perf_counter)
    seq: int  # arrival order
    phase: Phase = Phase.PENDING
    passed_at: float | None = None  # when a later request first started ahead of it (engine/batch/order.py)
    leader: int = -1  # WAITING: the uid of the request prefilling the shared prefix
    uid: int = -1  # in the batch: mlx-lm's BatchGenerator uid
    prepared: Prepared | None = None  # its assembled prefix (engine/cache/prefix_cache.py)
    detok: Any = None
    stops: StopMatcher | None = None
    generated: list[int] = field(default_factory=list)  # every sampled token, eos included
    num_generated: int = 0  # completion tokens sent to the client (eos not counted)
    ended_by_eos: bool = False  # the last sampled token was eos (usage counts it, as vLLM and mlx-lm do)
    first_token_s: float = 0.0
    prompt_registered: bool = False
    checkpoints: set[int] = field(default_factory=set)  # prompt positions to capture at (segment ends)
    fault: RequestFault = field(default_factory=RequestFault)  # what its sampler or processors raised
    # Its first token was sent when sampled, before the batch's decode pass reports it (engine/batch/direct_join.py).
    sent_ahead: bool = False

    @property
    def prefill_done(self) -> bool:
        """The whole prompt's KV is in the batch cache (or the request decodes alone)."""
        return self.phase in (Phase.DECODING, Phase.SOLO)

    def record(self, token: int) -> bool:
        """A sampled token (eos included); True when it is the first (its time is kept)."""
        self.generated.append(token)
        if len(self.generated) == 1:
            self.first_token_s = time.perf_counter() - self.started
        return len(self.generated) == 1

    def send(self, token: int, logprobs: Any) -> None:
        """A generated token (not eos) to the client: its text, less what may still become a stop
        string, and its log-probabilities when asked for."""
        self.num_generated += 1
        self.detok.add_token(token)
        text = self.stops.feed(self.detok.last_segment)
        chosen = token_logprobs(self.req.params, token, logprobs)
        if text or chosen:
            self.req.emit(TextDelta(text, 1, chosen))

    def send_rest(self) -> None:
        """At its end (not by a stop string or a cancel): the text the detokenizer and the stop
        strings still hold back, to the client."""
        self.detok.finalize()
        tail = self.stops.feed(self.detok.last_segment)
        tail += "" if self.stops.stopped else self.stops.flush()
        if tail:
            self.req.emit(TextDelta(tail, 0))


@dataclass
class SchedulerStats:
    """Counters since start (read by /health and /metrics from other threads: plain ints)."""

    prefill_tokens: int = 0  # prompt tokens run through the model (cached ones are not)
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    shared_prefix_waits: int = 0  # requests that waited for another's prompt blocks
    overdue_starts: int = 0  # requests started first because later ones had passed them for the bound
    max_wait_s: float = 0.0  # the longest any request waited to start (arrival to batch)


class PrefillProgress(NamedTuple):
    """One prompt prefilling now: `done` of its `total` uncached tokens (mlx-lm's progress), after
    `cached` tokens the cache supplied; `started` when it entered the batch (perf_counter)."""

    req: GenerationRequest
    done: int
    total: int
    cached: int
    started: float


def prefill_progress(by_uid: dict[int, tuple[int, int]], running: dict[int, Run]) -> list[PrefillProgress]:
    """The prompts in `by_uid` (the batch generator's progress) still running; any thread: both maps
    are only ever replaced or changed one key at a time, and read here through copies."""
    runs = dict(running)
    return [
        PrefillProgress(runs[uid].req, int(done), int(total), runs[uid].prepared.match.num_tokens, runs[uid].started)
        for uid, (done, total) in dict(by_uid).items()
        if uid in runs
    ]
