"""Speculative decoding (engine/speculative/speculator.py): a greedy request decoding alone with prompt-lookup
drafts gives exactly the tokens, text, logprobs and finish reason it gives without them; stop
strings, max_tokens, cancellation and a request joining mid-speculation included. Draft models and
sampled requests: tests/engine/test_speculative_draft.py."""

from __future__ import annotations

import pytest
from kvharness import make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from mlx_kvserve.engine.speculative.speculator import AdaptiveDepth, PromptLookup, Speculator

BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return load(str(smollm_dir))


def generator(model, tokenizer, speculate: bool, max_draft_tokens: int = 6, force: bool = False):
    gen = make_generator(model, tokenizer, BS)
    if speculate:
        spec = Speculator(model, set(tokenizer.eos_token_ids), "auto", max_draft_tokens)
        spec.refuse_layout(gen.prefix_cache.layout)
        if force:  # draft whenever a match is found (the tiny model on a busy CPU may not pay)
            spec.depth.choose = lambda accepted, rejected: spec.depth.max_depth
        gen.scheduler.speculation = spec
    return gen


def outcome(events: list) -> tuple:
    done = events[-1]
    assert isinstance(done, Finished), events
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    logprobs = [
        (lp.token, round(lp.logprob, 4), tuple(t for t, _ in lp.top))
        for e in events
        if isinstance(e, TextDelta)
        for lp in e.logprobs
    ]
    return done.token_ids, text, done.finish_reason, logprobs, done.usage


def run(gen, prompt: list[int], params: SamplingParams, name: str = "r") -> tuple:
    events: list = []
    gen.run(GenerationRequest(name, list(prompt), params, events.append))
    return outcome(events)


def repetitive(tokenizer) -> list[int]:
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(12))
    return tokenizer.encode(f"Copy this code exactly:\n{code}\nCopy:\n{code[:120]}")


def test_prompt_lookup_proposes_the_latest_continuation_on_a_tie():
    lookup = PromptLookup(max_ngram=3, min_ngram=2)
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup.propose(seq, 3) == [7, 8, 5]  # (1, 2, 3) was followed by 9 once and by 7 once, later
    assert lookup.propose([*seq, 7], 2) == [8, 5]
    assert lookup.propose([4, 5, 6], 3) == []


def test_prompt_lookup_drafts_the_most_frequent_continuation_and_past_one_match():
    # (1, 2, 3) was followed by 7 twice and by 9 last: 7 (llama.cpp's rule; the latest occurrence
    # alone drafts 9, 1, 2, 3)
    seq = [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3, 9, 1, 2, 3]
    assert PromptLookup().propose(seq, 4) == [7, 1, 2, 3]
    # a draft goes on past the end of the sequence: the drafts are looked up too
    assert PromptLookup().propose([1, 2, 3, 4, 1, 2, 3], 6) == [4, 1, 2, 3, 4, 1]
    # continuations that disagree (each a third of the time, down to the 1-gram) draft nothing
    assert PromptLookup().propose([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7, 3, 5, 6, 7], 4) == []
    # a 1-gram needs two sightings, two thirds of them agreeing (llama.cpp's lax thresholds)
    assert PromptLookup().propose([4, 8, 0, 4], 2) == []
    assert PromptLookup().propose([4, 8, 0, 4, 8, 2, 4], 1) == [8]


def test_prompt_lookup_index_grows_with_the_sequence():
    lookup = PromptLookup()
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    assert lookup.propose(seq, 2) == []
    seq += [3, 1, 4]  # accepted tokens: the index takes in what followed since the last call
    assert lookup.propose(seq, 3) == [1, 5, 9]


def test_adaptive_depth_stays_off_when_drafts_do_not_pay():
    depth = AdaptiveDepth(8)
    assert depth.choose(0, 0) == 0  # no one-token step measured yet
    depth.observe(1, 0.010)
    for w in range(2, 10):
        depth.observe(w, 0.010 * w)  # compute bound: k drafts cost k passes
    assert depth.choose(50, 1) == 0
    cheap = AdaptiveDepth(8, {w: 0.010 + 0.0005 * w for w in range(1, 10)})  # bandwidth bound
    assert cheap.choose(50, 1) == 8
    assert cheap.choose(0, 20) == 0


@pytest.mark.parametrize("which", ["tiny", "smollm"])
def test_greedy_equal_with_and_without_speculation_cold_and_cached(which, request):
    model, tokenizer = request.getfixturevalue(which)
    prompt = repetitive(tokenizer)
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=2)
    plain = run(generator(model, tokenizer, False), prompt, params)
    gen = generator(model, tokenizer, True, force=True)
    cold, hit = run(gen, prompt, params), run(gen, prompt, params)
    assert cold[:4] == plain[:4]
    assert hit[:4] == plain[:4] and hit[4].cached_tokens > 0
    stats = gen.scheduler.speculation.stats
    assert stats.solo_requests == 2 and stats.drafted_tokens > 0
    if which == "smollm":
        assert stats.accepted_tokens > 0


def test_stop_strings_and_max_tokens_are_exact(smollm):
    model, tokenizer = smollm
    prompt = repetitive(tokenizer)
    plain_gen, spec_gen = generator(model, tokenizer, False), generator(model, tokenizer, True, force=True)
    full = run(plain_gen, prompt, SamplingParams(max_tokens=40))
    stop = full[1][len(full[1]) // 2 : len(full[1]) // 2 + 3]
    for params in (
        SamplingParams(max_tokens=40, stop=(stop,)),
        SamplingParams(max_tokens=7),
        SamplingParams(max_tokens=2),
    ):
        assert run(spec_gen, prompt, params)[:3] == run(plain_gen, prompt, params)[:3], params


def test_cancel_while_decoding_alone(smollm):
    model, tokenizer = smollm
    gen = generator(model, tokenizer, True, force=True)
    events: list = []

    def emit(event):
        events.append(event)
        if sum(isinstance(e, TextDelta) for e in events) == 5:
            req.cancel()

    req = GenerationRequest("c", repetitive(tokenizer), SamplingParams(max_tokens=80), emit)
    gen.run(req)
    assert events[-1].finish_reason == "cancelled"
    assert gen.scheduler.speculation.solo is None and not gen.scheduler.has_work


def test_request_joining_mid_speculation_gets_the_same_output(smollm):
    model, tokenizer = smollm
    first, second = repetitive(tokenizer), tokenizer.encode("List the planets of the solar system in order:")
    params = SamplingParams(max_tokens=40)
    want = (
        run(generator(model, tokenizer, False), first, params)[:3],
        run(generator(model, tokenizer, False), second, params)[:3],
    )
    gen = generator(model, tokenizer, True, force=True)
    sched = gen.scheduler
    events: tuple[list, list] = ([], [])
    sched.admit(GenerationRequest("a", first, params, events[0].append))
    steps = 0
    while sched.has_work:
        if steps == 6:
            assert sched.speculation.solo is not None  # the first one decodes alone by now
            sched.admit(GenerationRequest("b", second, params, events[1].append))
        sched.step()
        steps += 1
    assert (outcome(events[0])[:3], outcome(events[1])[:3]) == want
    assert sched.speculation.stats.rejoins == 1


def test_which_requests_may_speculate():
    spec = Speculator(None, {0}, "auto", 4)
    assert spec.wants(SamplingParams(max_tokens=4))
    assert spec.wants(SamplingParams(max_tokens=4, temperature=0.7))  # sampled: engine/speculative/acceptance.py
    assert not spec.wants(SamplingParams(max_tokens=4, presence_penalty=0.5))
    assert not spec.wants(SamplingParams(max_tokens=4, json_schema={"type": "object"}))  # no tokenizer: no grammar
    assert Speculator(None, {0}, "auto", 4, tokenizer=object()).wants(SamplingParams(max_tokens=4, grammar="x"))
    assert not spec.wants(SamplingParams(max_tokens=4, speculative="off"))
    assert not Speculator(None, {0}, "off", 4).wants(SamplingParams(max_tokens=4))
    assert Speculator(None, {0}, "off", 4).wants(SamplingParams(max_tokens=4, speculative="prompt_lookup"))


def test_kvserve_extension_sets_the_request_mode():
    from mlx_kvserve.errors import ValidationError
    from mlx_kvserve.server.openai import parse as oa

    defaults = oa.Defaults(max_tokens=16, temperature=0.0, top_p=1.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "kvserve": {"speculative": "off"}}
    assert oa.parse_request(body, "chat", defaults).sampling(16).speculative == "off"
    assert oa.parse_request({**body, "kvserve": {}}, "chat", defaults).sampling(16).speculative == ""
    with pytest.raises(ValidationError):
        oa.parse_request({**body, "kvserve": {"speculative": "draft_model_please"}}, "chat", defaults)


def test_refused_for_layouts_that_cannot_rewind():
    class Layout:
        has_state, has_window, kv_bits = True, False, 0

    spec = Speculator(None, {0}, "auto", 4)
    spec.refuse_layout(Layout())
    assert spec.refused and not spec.wants(SamplingParams(max_tokens=4))


def test_health_and_metrics_report_drafts(smollm, smollm_dir, tmp_path, monkeypatch):
    import threading

    from starlette.testclient import TestClient

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import LoadedModel
    from mlx_kvserve.server.app import create_app

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    model, tokenizer = smollm
    config = load_config(overrides={"ssd": {"enabled": False}, "speculative": {"max_draft_tokens": 4}})
    engine = Engine(LoadedModel("smollm", smollm_dir, model, tokenizer, {}, 2048), config)
    engine.speculation.depth.choose = lambda accepted, rejected: 4  # draft wherever a match is found
    done = threading.Event()
    emit = lambda event: isinstance(event, Finished) and done.set()  # noqa: E731
    with TestClient(create_app(engine)) as client:
        engine.submit(GenerationRequest("r", repetitive(tokenizer), SamplingParams(max_tokens=30), emit))
        assert done.wait(120)
        spec = client.get("/health").json()["batch"]["speculative"]
        metrics = client.get("/metrics").text
    assert spec["mode"] == "auto" and spec["solo_requests"] == 1 and spec["drafted_tokens"] > 0
    assert f"mlx_kvserve_speculative_accepted_tokens_total {float(spec['accepted_tokens'])}" in metrics
