"""A short rest's first token comes from its own prefill (engine/batch/direct_join.py, issue 26): a later
turn is answered in the step that starts it, where mlx-lm's batch took two steps and a one-token pass
of its own; and every reply is the one the batch's own path gives (greedy, sampled, constrained,
with logprobs), alone or beside others."""

from __future__ import annotations

import pytest
from kvharness import greedy, make_generator
from mlx_lm.generate import GenerationBatch
from mlx_lm.utils import load

from mlx_kvserve.engine.batch import direct_join
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta

BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def story(tokenizer, topic: str) -> list[int]:
    return tokenizer.encode(f"Write a long story about {topic}, with many details. " * 6)


def run(gen, prompt: list[int], params: SamplingParams) -> tuple[list, int]:
    """(events, steps until the first text) of one request run alone to its end."""
    events: list = []
    scheduler = gen.scheduler
    req = GenerationRequest("r", list(prompt), params, events.append)
    scheduler.admit(req)
    steps, first = 0, 0
    while scheduler.is_running(req):
        scheduler.step()
        steps += 1
        if not first and any(isinstance(e, TextDelta) for e in events):
            first = steps
    assert isinstance(events[-1], Finished), events
    return events, first


def batch_path(monkeypatch) -> None:
    monkeypatch.setattr(direct_join, "fits", lambda *a: False)


def test_a_later_turn_is_answered_in_the_step_that_starts_it(tiny, monkeypatch):
    model, tokenizer = tiny
    base = story(tokenizer, "a lighthouse")
    question = base + tokenizer.encode(" And the keeper?")
    params = SamplingParams(max_tokens=10, temperature=0.0)
    firsts, outputs = {}, {}
    for name in ("direct", "batch"):
        if name == "batch":
            batch_path(monkeypatch)
        gen = make_generator(model, tokenizer, BS)
        greedy(gen, base + tokenizer.encode(" The end?"), 4)  # caches the story
        events, firsts[name] = run(gen, question, params)
        done = events[-1]
        assert done.usage.cached_tokens >= len(base) // BS * BS
        assert len(question) - done.usage.cached_tokens <= gen.scheduler.short_prefill_tokens
        outputs[name] = done.token_ids
    assert firsts == {"direct": 1, "batch": 2}
    cold = greedy(make_generator(model, tokenizer, BS), question, 10)[0]
    assert outputs["direct"] == outputs["batch"] == cold


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, temperature=0.9, seed=7, top_k=20),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5, logit_bias=((5, 4.0),)),
        SamplingParams(max_tokens=1, temperature=0.0),
    ],
    ids=["seeded", "logprobs", "penalties", "one-token"],
)
def test_a_direct_join_samples_as_the_batch_does(tiny, monkeypatch, params):
    model, tokenizer = tiny
    prompt = tokenizer.encode("Tell me about rivers.")
    replies = {}
    for name in ("direct", "batch"):
        if name == "batch":
            batch_path(monkeypatch)
        events, first = run(make_generator(model, tokenizer, BS), prompt, params)
        deltas = [e for e in events if isinstance(e, TextDelta)]
        logprobs = [(lp.token, round(lp.logprob, 4)) for d in deltas for lp in d.logprobs or ()]
        replies[name] = (events[-1].token_ids, events[-1].usage.completion_tokens, logprobs, first)
    direct, batch = replies["direct"], replies["batch"]
    assert direct[:3] == batch[:3]
    assert len(direct[0]) == min(params.max_tokens, direct[1])
    assert direct[3] < batch[3]
    if params.logprobs:
        assert len(direct[2]) == len(direct[0]) > 0


def test_a_burst_of_short_rests_shares_one_steps_budget(tiny, monkeypatch):
    """More short requests than one step's prefill budget: the first ones join directly, the rest take
    the batch's prompt step; those joining directly enter the decode batch together (one extend of its
    cache); every reply is its cold one."""
    model, tokenizer = tiny
    prompts = [tokenizer.encode(f"Question {i}: name a river in country number {i}.") for i in range(5)]
    expected = [greedy(make_generator(model, tokenizer, BS), p, 6)[0] for p in prompts]
    gen = make_generator(model, tokenizer, BS)
    scheduler = gen.scheduler
    scheduler.prefill_step_size = 2 * max(len(p) for p in prompts)  # room for two direct joins a step
    events: list[list] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        scheduler.admit(GenerationRequest(f"q{i}", p, SamplingParams(max_tokens=6, temperature=0.0), events[i].append))
    extends = []
    real_extend = GenerationBatch.extend
    monkeypatch.setattr(GenerationBatch, "extend", lambda self, other: extends.append(1) or real_extend(self, other))
    scheduler.step()
    answered = [any(isinstance(e, TextDelta) for e in evs) for evs in events]
    assert answered.count(True) == 2  # the budget's two; the others were prefilled in the batch's step
    assert len(extends) == 1  # the two entered the decode batch together
    while scheduler.has_work:
        scheduler.step()
    assert [evs[-1].token_ids for evs in events] == expected


def test_the_first_token_is_sent_before_the_steps_decode_pass(tiny, monkeypatch):
    """Beside a request decoding, a later turn joins directly: its first token's text reaches the client
    before the step's decode pass (which reports it again: not sent twice), and its reply, text and
    logprobs are its cold run's."""
    model, tokenizer = tiny
    base = story(tokenizer, "a harbour")
    question = base + tokenizer.encode(" And the boats?")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    cold_events, _ = run(make_generator(model, tokenizer, BS), question, params)
    gen = make_generator(model, tokenizer, BS)
    greedy(gen, base + tokenizer.encode(" The end?"), 4)  # caches the story
    scheduler = gen.scheduler
    other: list = []
    scheduler.admit(
        GenerationRequest(
            "other", tokenizer.encode("Count slowly to fifty:"), SamplingParams(max_tokens=40), other.append
        )
    )
    scheduler.step()
    scheduler.step()  # the other request is decoding
    events: list = []
    seen_at_decode: list[int] = []
    real_next = GenerationBatch.next

    def decode_pass(self):
        seen_at_decode.append(sum(isinstance(e, TextDelta) for e in events))
        return real_next(self)

    monkeypatch.setattr(GenerationBatch, "next", decode_pass)
    req = GenerationRequest("turn", list(question), params, events.append)
    scheduler.admit(req)
    scheduler.step()
    assert seen_at_decode == [1]  # the join's step: its first token already sent when the pass began
    assert sum(isinstance(e, TextDelta) for e in events) == 1  # and not again by the pass's report
    while scheduler.is_running(req):
        scheduler.step()
    done, cold = events[-1], cold_events[-1]
    assert done.usage.cached_tokens > 0 and done.token_ids == cold.token_ids
    texts = ["".join(e.text for e in evs if isinstance(e, TextDelta)) for evs in (events, cold_events)]
    assert texts[0] == texts[1] and texts[0]
    logprobs = [
        [lp.token for e in evs if isinstance(e, TextDelta) for lp in e.logprobs or ()] for evs in (events, cold_events)
    ]
    assert logprobs[0] == logprobs[1] and len(logprobs[0]) == len(done.token_ids)
    assert done.usage.completion_tokens == cold.usage.completion_tokens


@pytest.mark.parametrize("ending", ["stop string", "cancelled"])
def test_a_request_sent_its_first_token_ahead_still_ends_as_on_the_batch_path(tiny, monkeypatch, ending):
    """A stop string in the first tokens: the request ends as it does when the batch reports its first
    token (same tokens, text and reason). A cancel right after the join: cancelled, with the one token
    already sent (the batch path sends it at its move to decoding, also before the cancel is seen)."""
    model, tokenizer = tiny
    base = story(tokenizer, "a mill")
    question = base + tokenizer.encode(" And the miller?")
    reply = tokenizer.decode(greedy(make_generator(model, tokenizer, BS), question, 3)[0])
    stop = (reply.strip()[:2] or reply[:2],) if ending == "stop string" else ()
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=stop)
    ends = {}
    for name in ("direct", "batch"):
        if name == "batch":
            batch_path(monkeypatch)
        gen = make_generator(model, tokenizer, BS)
        greedy(gen, base + tokenizer.encode(" The end?"), 4)  # caches the story
        events: list = []
        req = GenerationRequest("turn", list(question), params, events.append)
        gen.scheduler.admit(req)
        gen.scheduler.step()
        if ending == "cancelled":
            req.cancelled.set()
        while gen.scheduler.is_running(req):
            gen.scheduler.step()
        done = events[-1]
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        ends[name] = (done.finish_reason, done.token_ids, text)
    if ending == "stop string":
        assert ends["direct"] == ends["batch"] and ends["direct"][0] == "stop"
        assert stop[0] not in ends["direct"][2]
    else:  # both sent the first token ahead (the batch path at its move to decoding) before the cancel
        first = greedy(make_generator(model, tokenizer, BS), question, 1)[0]
        assert ends["direct"] == ends["batch"] and ends["direct"][:2] == ("cancelled", tuple(first))


def test_a_cold_prompts_first_token_is_sent_before_the_decode_pass_that_reports_it(tiny, monkeypatch):
    """A cold prompt beside a request decoding: its first token is sampled by the move's one-token pass
    and sent then (batch_generator.py on_first_tokens); no decode pass is the one that brings its first
    text. Its reply, text and logprobs are its run alone's."""
    model, tokenizer = tiny
    prompt = story(tokenizer, "a glacier")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)  # a TextDelta for every token
    alone, _ = run(make_generator(model, tokenizer, BS), prompt, params)
    batch_path(monkeypatch)  # the prompt batch prefills it and moves it to decoding (no direct join)
    gen = make_generator(model, tokenizer, BS)
    scheduler = gen.scheduler
    other: list = []
    scheduler.admit(
        GenerationRequest("other", tokenizer.encode("Count to fifty:"), SamplingParams(max_tokens=60), other.append)
    )
    scheduler.step()
    scheduler.step()
    events: list = []
    at_report: list[int] = []  # texts already sent when the decode pass that reports its first token began
    real_next = GenerationBatch.next

    def decode_pass(self):
        before = sum(isinstance(e, TextDelta) for e in events)
        out = real_next(self)
        uid = next((u for u, run in scheduler._running.items() if run.req is req), None)
        if not at_report and any(r.uid == uid for r in out):
            at_report.append(before)
        return out

    monkeypatch.setattr(GenerationBatch, "next", decode_pass)
    req = GenerationRequest("cold", list(prompt), params, events.append)
    scheduler.admit(req)
    while scheduler.is_running(req):
        scheduler.step()
    assert at_report == [1]  # sent before that pass (the batch alone would send it after)
    done, expected = events[-1], alone[-1]
    assert done.usage.cached_tokens == 0 and done.token_ids == expected.token_ids
    texts = ["".join(e.text for e in evs if isinstance(e, TextDelta)) for evs in (events, alone)]
    assert texts[0] == texts[1]
    logprobs = [
        [lp.token for e in evs if isinstance(e, TextDelta) for lp in e.logprobs or ()] for evs in (events, alone)
    ]
    assert logprobs[0] == logprobs[1] and len(logprobs[0]) == len(done.token_ids)
