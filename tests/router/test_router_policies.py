"""Seed 004's routing policies, one test per branch of each picker's pseudocode, on fake snapshots."""

import pytest

from mlx_kvserve.router.policies import (
    BackendView,
    NoBackendError,
    Policy,
    PolicyState,
    Reason,
    RouteRequest,
    apply_decision,
    choose,
    pick_lmetric,
    pick_load_only,
    pick_round_robin,
    pick_sticky,
    pick_unified,
)


def view(name, reqs=0, pending=0, hit=0, decode=0) -> BackendView:
    return BackendView(name, reqs, pending, decode, hit)


def req(length=1000, session=None) -> RouteRequest:
    return RouteRequest(length, session)


# --- lmetric ---------------------------------------------------------------------------------------------


def test_lmetric_prefers_lowest_prefill_times_batch():
    # a: (0 + 1000) x 2 = 2000; b: (500 + 1000) x 1 = 1500; c: (0 + 1000) x 3 = 3000
    backends = [view("a", reqs=2), view("b", reqs=1, pending=500), view("c", reqs=3)]
    d = pick_lmetric(backends, req(1000))
    assert (d.index, d.name, d.reason) == (1, "b", Reason.LOWEST_SCORE)


def test_lmetric_cache_hit_reduces_new_prefill():
    # equal load: the warm backend's new prefill is 200, the cold one's 1000
    backends = [view("cold", reqs=1), view("warm", reqs=1, hit=800)]
    assert pick_lmetric(backends, req(1000)).name == "warm"


def test_lmetric_tie_keeps_first_seen():
    # idle backends all score 0: strict `<` keeps the first
    backends = [view("a"), view("b", hit=1000), view("c")]
    assert pick_lmetric(backends, req(1000)).index == 0


def test_lmetric_hit_larger_than_prompt_clamps_to_zero():
    backends = [view("a", reqs=1, pending=10, hit=5000), view("b", reqs=1, pending=0)]
    # a: (10 + 0) x 1 = 10; b: (0 + 100) x 1 = 100
    assert pick_lmetric(backends, req(100)).name == "a"


# --- load_only -------------------------------------------------------------------------------------------


def test_load_only_fewest_requests_ignores_cache():
    backends = [view("a", reqs=3, hit=1000), view("b", reqs=1), view("c", reqs=2)]
    d = pick_load_only(backends)
    assert (d.name, d.reason) == ("b", Reason.LEAST_LOADED)


def test_load_only_tie_goes_to_first_seen():
    assert pick_load_only([view("a"), view("b"), view("c")]).index == 0


# --- sticky ----------------------------------------------------------------------------------------------


def test_sticky_first_turn_binds_least_loaded():
    state = PolicyState()
    backends = [view("a", reqs=2), view("b", reqs=0)]
    d = pick_sticky(backends, req(session="s"), state)
    assert (d.name, d.reason, d.bind_session) == ("b", Reason.LEAST_LOADED, True)
    apply_decision(state, req(session="s"), d)
    assert state.affinity == {"s": "b"}


def test_sticky_bound_session_stays_under_any_load():
    state = PolicyState(affinity={"s": "b"})
    backends = [view("a"), view("b", reqs=50, pending=10_000)]
    d = pick_sticky(backends, req(session="s"), state)
    assert (d.name, d.reason) == ("b", Reason.AFFINITY)


def test_sticky_bound_backend_down_rebinds():
    state = PolicyState(affinity={"s": "gone"})
    d = pick_sticky([view("a", reqs=1), view("b")], req(session="s"), state)
    apply_decision(state, req(session="s"), d)
    assert d.name == "b" and state.affinity == {"s": "b"}


def test_sticky_without_session_binds_nothing():
    state = PolicyState()
    d = pick_sticky([view("a")], req(session=None), state)
    apply_decision(state, req(session=None), d)
    assert state.affinity == {}


# --- unified ---------------------------------------------------------------------------------------------


def test_unified_affinity_gate_holds():
    # warm (hit 600/1000 > 0.5) and not overloaded (3 <= 2 x avg 2): stick even though b scores lower
    state = PolicyState(affinity={"s": "a"})
    backends = [view("a", reqs=3, hit=600), view("b", reqs=1), view("c", reqs=2)]
    d = pick_unified(backends, req(1000, "s"), state)
    assert (d.name, d.reason) == ("a", Reason.AFFINITY)


def test_unified_gate_needs_hit_ratio_above_half():
    # exactly 0.5 is not enough: lmetric decides, b has the lower score
    state = PolicyState(affinity={"s": "a"})
    # a: (0 + 500) x 3 = 1500; b: (0 + 1000) x 1 = 1000
    backends = [view("a", reqs=3, hit=500), view("b", reqs=1)]
    d = pick_unified(backends, req(1000, "s"), state)
    assert (d.name, d.reason) == ("b", Reason.AFFINITY_COLD)


def test_unified_gate_breaks_on_overload():
    # avg = (7 + 0 + 1) / 3 = 2.67; 7 > 2 x 2.67: steer away despite a warm cache
    state = PolicyState(affinity={"s": "a"})
    # lmetric: a (400 x 7 = 2800), b ((5 + 1000) x 0 = 0), c (1000 x 1)
    backends = [view("a", reqs=7, hit=600), view("b", reqs=0, pending=5), view("c", reqs=1)]
    d = pick_unified(backends, req(1000, "s"), state)
    assert d.reason == Reason.AFFINITY_OVERLOADED and d.name == "b"


def test_unified_gate_reason_survives_a_round_robin_tie():
    # a is overloaded; b and c tie on (score, new_prefill, num_requests): the turn goes round, the label says why
    state = PolicyState(affinity={"s": "a"}, rr_counter=1)
    backends = [view("a", reqs=9, pending=100, hit=1000), view("b"), view("c")]  # a: 100 x 9; b, c: 1000 x 0
    d = pick_unified(backends, req(1000, "s"), state)
    assert (d.name, d.reason, d.used_round_robin, d.bind_session) == ("c", Reason.AFFINITY_OVERLOADED, True, True)


def test_unified_overload_factor_is_configurable():
    state = PolicyState(affinity={"s": "a"})
    backends = [view("a", reqs=7, hit=1000), view("b", reqs=0), view("c", reqs=1)]
    assert pick_unified(backends, req(1000, "s"), state, overload_factor=4.0).reason == Reason.AFFINITY


def test_unified_average_floored_at_one():
    # avg of (2, 0, 0) is 0.67, floored to 1: 2 <= 2 x 1 still sticks
    state = PolicyState(affinity={"s": "a"})
    backends = [view("a", reqs=2, hit=900), view("b"), view("c")]
    assert pick_unified(backends, req(1000, "s"), state).reason == Reason.AFFINITY


def test_unified_tie_break_prefers_lower_new_prefill_then_fewer_requests():
    state = PolicyState()
    # all idle: score 0 everywhere; b has the smallest new_prefill
    d = pick_unified([view("a"), view("b", hit=800), view("c", hit=400)], req(1000), state)
    assert (d.name, d.reason, d.used_round_robin) == ("b", Reason.LOWEST_SCORE, False)
    # equal score (0) and new_prefill: fewer requests wins (a has pending 0 so score 0 with 1 request)
    d = pick_unified([view("a", reqs=1, hit=1000), view("b", reqs=0, hit=1000)], req(1000), state)
    assert d.name == "b"


def test_unified_cold_start_round_robins_among_ties():
    state = PolicyState()
    backends = [view("a"), view("b"), view("c")]
    names = []
    for _ in range(4):
        d = pick_unified(backends, req(1000), state)
        assert d.reason == Reason.TIE_ROUND_ROBIN
        apply_decision(state, req(1000), d)
        names.append(d.name)
    assert names == ["a", "b", "c", "a"] and state.rr_counter == 4


def test_unified_binds_winner_as_affinity():
    state = PolicyState()
    d = pick_unified([view("a", reqs=1), view("b")], req(1000, "s"), state)
    apply_decision(state, req(1000, "s"), d)
    assert state.affinity == {"s": "b"}


def test_unified_affinity_backend_down_falls_back_to_lmetric():
    state = PolicyState(affinity={"s": "gone"})
    d = pick_unified([view("a", reqs=1), view("b", reqs=2)], req(1000, "s"), state)
    assert (d.name, d.reason) == ("a", Reason.LOWEST_SCORE)


# --- round_robin and dispatch ----------------------------------------------------------------------------


def test_round_robin_cycles_ignoring_load():
    state = PolicyState()
    backends = [view("a", reqs=9), view("b"), view("c")]
    names = []
    for _ in range(4):
        d = pick_round_robin(backends, state)
        apply_decision(state, req(), d)
        names.append(d.name)
    assert names == ["a", "b", "c", "a"]


@pytest.mark.parametrize("policy", list(Policy))
def test_choose_dispatches_and_rejects_empty(policy):
    state = PolicyState()
    assert choose(policy, [view("only")], req(session="s"), state).name == "only"
    with pytest.raises(NoBackendError):
        choose(policy, [], req(), state)
