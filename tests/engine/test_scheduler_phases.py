"""One Run per request, its Phase moved on by the Scheduler (engine/batch/state.py, issue 48): a request is
pending until it starts, prefills in the batch, then decodes; one that shares the prefix another is prefilling
waits for it (its leader's uid) and then starts as a hit. Each Run sits in the one place its phase names."""

from __future__ import annotations

import pytest
from kvharness import make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.batch.state import Phase
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def phases(scheduler, reqs) -> list[Phase | None]:
    """Each request's phase now (None once it has left), checked against where its Run sits."""
    places = {Phase.PENDING: scheduler._pending, Phase.WAITING: scheduler._waiting}
    out = []
    for req in reqs:
        runs = [r for r in [*scheduler._pending, *scheduler._waiting, *scheduler._running.values()] if r.req is req]
        assert len(runs) <= 1
        if not runs:
            out.append(None)
            continue
        run = runs[0]
        held = places.get(run.phase)
        assert run in held if held is not None else scheduler._running.get(run.uid) is run
        out.append(run.phase)
    return out


def test_a_request_moves_through_its_phases_and_a_shared_prefix_waits_for_its_leader(tiny):
    model, tokenizer = tiny
    text = " ".join(f"Rule {i}: a visitor to room {i} signs the book at desk {i * 2}." for i in range(40))
    shared = tokenizer.encode(text)[: 16 * BS]
    prompts = [shared + tokenizer.encode(f" Question {q}: which desk?") for q in range(2)]
    gen = make_generator(model, tokenizer, BS, prefill_step_size=64)  # the prefix takes several steps
    scheduler = gen.scheduler
    scheduler.prefill_batch_size = 2
    events: list[list] = [[], []]
    reqs = [
        GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=4), events[i].append) for i, p in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.admit(req)
    seen = [phases(scheduler, reqs)]
    while scheduler.has_work:
        scheduler.step()
        seen.append(phases(scheduler, reqs))
    assert seen[0] == [Phase.PENDING, Phase.PENDING]
    assert seen[1] == [Phase.PREFILLING, Phase.WAITING]  # the second waits for the first's prompt blocks
    firsts = [s[0] for s in seen]
    seconds = [s[1] for s in seen]
    # Each phase in order, once: no step goes back.
    order = [Phase.PENDING, Phase.PREFILLING, Phase.DECODING, None]
    assert [p for i, p in enumerate(firsts) if i == 0 or firsts[i - 1] != p] == order
    second_order = [p for i, p in enumerate(seconds) if i == 0 or seconds[i - 1] != p]
    assert second_order[:2] == [Phase.PENDING, Phase.WAITING] and second_order[-1] is None
    assert Phase.DECODING in second_order
    assert scheduler.stats.shared_prefix_waits == 1
    dones = [e[-1] for e in events]
    assert all(isinstance(d, Finished) for d in dones)
    assert dones[1].usage.cached_tokens >= len(shared)  # started as a hit on the leader's blocks
    gen.prefix_cache.manager.check_integrity()
