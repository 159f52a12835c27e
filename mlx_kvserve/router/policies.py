"""Seed 004's routing policies as pure functions of a snapshot.

Every picker takes the up backends' state at the moment of the decision (`BackendView`), the request
(`RouteRequest`) and the router's small memory (`PolicyState`: session affinity and a round-robin counter),
and returns a `Decision`; nothing here mutates anything. `apply_decision` is the one place the memory changes,
so the pickers can be tested branch by branch without a server.

Affinity maps a session to a backend *name* (its URL), not an index: a backend that is down is simply absent
from the snapshot, and the affinity to it is treated as missing until it comes back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mlx_kvserve.errors import KVServeError

DEFAULT_OVERLOAD_FACTOR = 2.0
AFFINITY_HIT_RATIO = 0.5  # unified sticks only when more than half the prompt is already cached there


class NoBackendError(KVServeError):
    """No backend is up to serve the request (503)."""

    status_code = 503
    error_type = "server_error"


class Policy(str, enum.Enum):
    LMETRIC = "lmetric"
    LOAD_ONLY = "load_only"
    STICKY = "sticky"
    UNIFIED = "unified"
    ROUND_ROBIN = "round_robin"


class Reason(str, enum.Enum):
    """Which branch of the policy's pseudocode chose the backend (a label on /metrics)."""

    LOWEST_SCORE = "lowest_score"  # lmetric: smallest (pending + new prefill) x num_requests
    LEAST_LOADED = "least_loaded"  # load_only / sticky first turn: fewest requests, first seen on ties
    AFFINITY = "affinity"  # sticky: the bound backend; unified: the gate held
    AFFINITY_COLD = "affinity_cold"  # unified: bound backend's hit ratio <= 0.5, fell back to lmetric
    AFFINITY_OVERLOADED = "affinity_overloaded"  # unified: bound backend above factor x average load
    TIE_ROUND_ROBIN = "tie_round_robin"  # unified, no affinity: several backends share the best 3-key tuple
    ROUND_ROBIN = "round_robin"  # round_robin policy


class BackendView(NamedTuple):
    """One up backend as the picker sees it; `cache_hit_tokens` is estimated for this request's tokens."""

    name: str
    num_requests: int  # in flight through the router (waiting + running)
    pending_prefill_tokens: int
    decode_tokens: int
    cache_hit_tokens: int


class RouteRequest(NamedTuple):
    input_length: int  # prompt tokens
    session_id: str | None


class Decision(NamedTuple):
    """The chosen backend (index into the snapshot and its name), why, and how the memory should change."""

    index: int
    name: str
    reason: Reason
    bind_session: bool  # record session -> name in the affinity map
    used_round_robin: bool  # advance the round-robin counter


@dataclass
class PolicyState:
    """The router's memory between decisions; only `apply_decision` changes it (under the router's lock)."""

    affinity: dict[str, str] = field(default_factory=dict)
    rr_counter: int = 0


def _decision(backends: Sequence[BackendView], index: int, reason: Reason, *, bind=False, rr=False) -> Decision:
    return Decision(index, backends[index].name, reason, bind, rr)


def _lmetric_key(view: BackendView, input_length: int, index: int) -> tuple[int, int, int, int]:
    """(score, new_prefill, num_requests, index): score is the expected prefill cost times the batch size."""
    new_prefill = max(0, input_length - view.cache_hit_tokens)
    score = (view.pending_prefill_tokens + new_prefill) * view.num_requests
    return (score, new_prefill, view.num_requests, index)


def _least_loaded(backends: Sequence[BackendView]) -> int:
    # Python's min keeps the first seen on ties, as the seed's load_only does (index 0 at a cold start).
    return min(range(len(backends)), key=lambda i: backends[i].num_requests)


def _affinity_index(backends: Sequence[BackendView], session_id: str | None, affinity: Mapping[str, str]):
    if session_id is None or session_id not in affinity:
        return None
    name = affinity[session_id]
    return next((i for i, b in enumerate(backends) if b.name == name), None)


def pick_lmetric(backends: Sequence[BackendView], request: RouteRequest) -> Decision:
    """Lowest (pending_prefill + new_prefill) x num_requests; strict `<` keeps the first seen on ties."""
    best, best_score = 0, None
    for i, view in enumerate(backends):
        score = _lmetric_key(view, request.input_length, i)[0]
        if best_score is None or score < best_score:
            best, best_score = i, score
    return _decision(backends, best, Reason.LOWEST_SCORE)


def pick_load_only(backends: Sequence[BackendView]) -> Decision:
    """Fewest requests in flight, ignoring the cache and the session."""
    return _decision(backends, _least_loaded(backends), Reason.LEAST_LOADED)


def pick_sticky(backends: Sequence[BackendView], request: RouteRequest, state: PolicyState) -> Decision:
    """A bound session always goes to its backend; an unbound one goes to the least loaded and is bound."""
    bound = _affinity_index(backends, request.session_id, state.affinity)
    if bound is not None:
        return _decision(backends, bound, Reason.AFFINITY)
    return _decision(backends, _least_loaded(backends), Reason.LEAST_LOADED, bind=request.session_id is not None)


def pick_unified(
    backends: Sequence[BackendView],
    request: RouteRequest,
    state: PolicyState,
    overload_factor: float = DEFAULT_OVERLOAD_FACTOR,
) -> Decision:
    """Gated affinity, then lmetric with the 4-key tie-break and round-robin among ties.

    The session sticks to its backend only when that backend's estimated hit ratio is above 0.5 and its
    requests are at most `overload_factor` x the average (the average floored at 1). Otherwise the keys
    (score, new_prefill, num_requests, index) decide; backends tied on the first three take turns by the
    router's round-robin counter. The winner becomes the session's affinity backend.
    """
    bind = request.session_id is not None
    fallback_reason = Reason.LOWEST_SCORE
    bound = _affinity_index(backends, request.session_id, state.affinity)
    if bound is not None:
        view = backends[bound]
        avg_reqs = max(sum(b.num_requests for b in backends) / len(backends), 1.0)
        hit_ratio = view.cache_hit_tokens / max(request.input_length, 1)
        if hit_ratio <= AFFINITY_HIT_RATIO:
            fallback_reason = Reason.AFFINITY_COLD
        elif view.num_requests > avg_reqs * overload_factor:
            fallback_reason = Reason.AFFINITY_OVERLOADED
        else:
            return _decision(backends, bound, Reason.AFFINITY, bind=bind)
    keys = [_lmetric_key(view, request.input_length, i) for i, view in enumerate(backends)]
    best = min(k[:3] for k in keys)
    tied = [k for k in keys if k[:3] == best]
    if len(tied) > 1:
        winner = tied[state.rr_counter % len(tied)]
        # A broken affinity gate is the more telling label; the round-robin turn is taken either way.
        reason = Reason.TIE_ROUND_ROBIN if fallback_reason == Reason.LOWEST_SCORE else fallback_reason
        return _decision(backends, winner[3], reason, bind=bind, rr=True)
    return _decision(backends, tied[0][3], fallback_reason, bind=bind)


def pick_round_robin(backends: Sequence[BackendView], state: PolicyState) -> Decision:
    """The next backend in turn, ignoring load, cache and session."""
    return _decision(backends, state.rr_counter % len(backends), Reason.ROUND_ROBIN, rr=True)


def choose(
    policy: Policy,
    backends: Sequence[BackendView],
    request: RouteRequest,
    state: PolicyState,
    overload_factor: float = DEFAULT_OVERLOAD_FACTOR,
) -> Decision:
    """Dispatch to the policy's picker; raises NoBackendError when the snapshot is empty."""
    if not backends:
        raise NoBackendError("no backend is up")
    pickers: dict[Policy, Callable[[], Decision]] = {
        Policy.LMETRIC: lambda: pick_lmetric(backends, request),
        Policy.LOAD_ONLY: lambda: pick_load_only(backends),
        Policy.STICKY: lambda: pick_sticky(backends, request, state),
        Policy.UNIFIED: lambda: pick_unified(backends, request, state, overload_factor),
        Policy.ROUND_ROBIN: lambda: pick_round_robin(backends, state),
    }
    return pickers[Policy(policy)]()


def apply_decision(state: PolicyState, request: RouteRequest, decision: Decision) -> None:
    """Record what the decision asks for: the session's backend and one turn of the round-robin counter."""
    if decision.bind_session and request.session_id is not None:
        state.affinity[request.session_id] = decision.name
    if decision.used_round_robin:
        state.rr_counter += 1
