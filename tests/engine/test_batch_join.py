"""A cached prefix joining mlx-lm's batch alone is not copied on the way (issue 26, "no copies"):
the assembled keys and values become the batch's cache (room kept for the prefill to write into),
and move from prompt processing to decoding as they are. Requests joining together, or a batch
that splits, still take mlx-lm's copying paths, and every path gives the tokens of a cold run."""

from __future__ import annotations

import pytest
from kvharness import greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.batch import direct_join
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.kv import cache_fill

BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def prompt(tokenizer, topic: str) -> list[int]:
    return tokenizer.encode(f"Write a long story about {topic}, with many details. " * 6)


def watched_keys(monkeypatch) -> list:
    """Each lone join's (assembled keys, the batch cache made from them)."""
    seen = []
    real = cache_fill.merge_alone

    def spy(merge, caches):
        batch = real(merge, caches)
        seen.append((caches[0].keys, batch))
        return batch

    monkeypatch.setattr(cache_fill, "merge_alone", spy)
    return seen


def test_a_lone_hit_reaches_decoding_with_its_assembled_arrays(tiny, monkeypatch):
    model, tokenizer = tiny
    gen = make_generator(model, tokenizer, BS)
    base = prompt(tokenizer, "a lighthouse")
    cold = greedy(gen, base + tokenizer.encode(" The end?"), 12)  # computes and caches the prefix
    seen = watched_keys(monkeypatch)
    events: list = []
    question = base + tokenizer.encode(" And the keeper?")
    req = GenerationRequest("q", question, SamplingParams(max_tokens=12, temperature=0.0), events.append)
    scheduler = gen.scheduler
    scheduler.admit(req)
    batch_keys = None
    while scheduler.is_running(req):
        scheduler.step()
        decoding = scheduler._generator()._generation_batch
        if len(decoding) and batch_keys is None:
            batch_keys = decoding.prompt_cache[0].keys
    assert len(seen) == len(model.layers), "the hit joined alone (one merge per layer)"
    assert all(batch.keys is assembled for assembled, batch in seen)  # the batch holds the assembled arrays
    assembled, batch = seen[0]
    assert batch_keys is assembled  # ... and reached decoding as they were (no deepcopy, no gather)
    assert assembled.shape[2] > batch._idx  # room was kept: the prefill wrote in place
    done = events[-1]
    assert done.usage.cached_tokens >= len(base) // BS * BS
    alone = make_generator(model, tokenizer, BS)
    assert done.token_ids == greedy(alone, question, 12)[0]  # = a cold run
    assert cold[0] == greedy(alone, base + tokenizer.encode(" The end?"), 12)[0]


def test_hits_joining_together_or_splitting_give_cold_tokens(tiny):
    """Two cached requests joining at once (mlx-lm's copying merge), and one that finishes while
    the other still decodes (a split that keeps rows): the tokens of each alone, cold."""
    model, tokenizer = tiny
    prompts = [prompt(tokenizer, t) for t in ("a lighthouse", "a glacier")]
    questions = [p + tokenizer.encode(" What next?") for p in prompts]
    expected = [greedy(make_generator(model, tokenizer, BS), q, n)[0] for q, n in zip(questions, (5, 14), strict=True)]
    gen = make_generator(model, tokenizer, BS)
    for p in prompts:
        greedy(gen, p + tokenizer.encode(" Begin."), 3)
    outs: list[list] = [[], []]
    reqs = [
        GenerationRequest(f"r{i}", q, SamplingParams(max_tokens=n, temperature=0.0), outs[i].append)
        for i, (q, n) in enumerate(zip(questions, (5, 14), strict=True))
    ]
    for r in reqs:
        gen.scheduler.admit(r)
    while any(gen.scheduler.is_running(r) for r in reqs):
        gen.scheduler.step()
    assert [o[-1].token_ids for o in outs] == expected
    assert all(o[-1].usage.cached_tokens > 0 for o in outs)


def test_the_first_token_comes_in_the_step_after_the_last_prefill_chunk(tiny):
    """mlx-lm moves a prompt to decoding only after the next step's decode pass, so its first token
    came two steps after its last prefill chunk; it now comes in the next step."""
    model, tokenizer = tiny
    gen = make_generator(model, tokenizer, BS)
    question = prompt(tokenizer, "a harbour")
    events: list = []
    req = GenerationRequest("s", question, SamplingParams(max_tokens=4, temperature=0.0), events.append)
    gen.scheduler.admit(req)
    steps = 0
    while not any(run.generated for run in gen.scheduler._running.values()):
        gen.scheduler.step()
        steps += 1
    chunks = -(-(len(question) - 1) // gen.scheduler.prefill_step_size)  # all but the last token
    assert (steps, chunks) == (chunks + 1, chunks)
    while gen.scheduler.is_running(req):
        gen.scheduler.step()
    assert events[-1].token_ids == greedy(make_generator(model, tokenizer, BS), question, 4)[0]


def watch_passes(monkeypatch, sched) -> tuple[list[set[int]], dict[str, int]]:
    """From now on: the uids in each of the batch's prefill passes, and for each request the number of
    passes run before the batch produced its first token (its text may wait for the next token)."""
    passes: list[set[int]] = []
    first_at: dict[str, int] = {}
    batch_class = type(sched._batch._prompt_batch)
    real_prompt, on_token = batch_class.prompt, sched._on_token

    def counted(self, tokens):
        passes.append(set(self.uids))
        return real_prompt(self, tokens)

    def first_token(run, r):
        first_at.setdefault(run.req.request_id, len(passes))
        return on_token(run, r)

    monkeypatch.setattr(batch_class, "prompt", counted)
    monkeypatch.setattr(sched, "_on_token", first_token)
    return passes, first_at


def test_a_first_token_does_not_wait_for_another_prompts_next_chunk(tiny, monkeypatch):
    """A short prompt prefilled next to a long one (many chunks) gets its first token in a step of its
    own: mlx-lm's step would prefill the long prompt's next chunk before returning it. Counted in
    prefill passes: the short prompt's first token is out before any pass after its own last one."""
    model, tokenizer = tiny
    gen = make_generator(model, tokenizer, BS, prefill_step_size=32)
    sched = gen.scheduler
    sched.prefill_batch_size, sched.short_prefill_tokens = 2, 1  # both prefill in the batch's passes
    long_prompt = prompt(tokenizer, "a lighthouse")[:300]  # ~10 chunks
    short_prompt = tokenizer.encode("Name a colour.")
    outs: dict[str, list] = {"long": [], "short": []}
    params = SamplingParams(max_tokens=3, temperature=0.0)
    sched.admit(GenerationRequest("long", long_prompt, params, outs["long"].append))
    sched.step()  # the long prompt's first chunk
    passes, first_at = watch_passes(monkeypatch, sched)
    sched.admit(GenerationRequest("short", short_prompt, params, outs["short"].append))
    while sched.has_work:
        sched.step()
    uid = next(iter(passes[0] - passes[1]))  # the short prompt's uid: its ~5 tokens take one pass
    last_short_pass = max(i for i, run in enumerate(passes) if uid in run) + 1
    assert first_at["short"] == last_short_pass < first_at["long"]
    for name, tokens in (("long", long_prompt), ("short", short_prompt)):
        assert outs[name][-1].token_ids == greedy(make_generator(model, tokenizer, BS), tokens, 3)[0]


def test_a_short_rest_beside_a_long_prefill_is_prefilled_alone_and_decodes_at_once(tiny, monkeypatch):
    """A request whose uncached rest is short (at most short_prefill_tokens) arriving while a long prompt
    prefills is prefilled on its own cache, last token included, and joins decoding with its first
    token (engine/batch/direct_join.py): it is never in one of the batch's padded prefill passes, its first
    token comes before the long prompt's next pass, and both replies equal their replies alone."""
    model, tokenizer = tiny
    gen = make_generator(model, tokenizer, BS, prefill_step_size=32)
    sched = gen.scheduler
    long_prompt = prompt(tokenizer, "a lighthouse")[:300]
    short_prompt = prompt(tokenizer, "a cat")[:6]  # a rest of 5 tokens <= 32 // 4
    outs: dict[str, list] = {"long": [], "short": []}
    params = SamplingParams(max_tokens=3, temperature=0.0)
    sched.admit(GenerationRequest("long", long_prompt, params, outs["long"].append))
    sched.step()
    passes, first_at = watch_passes(monkeypatch, sched)
    prefilled = sched.stats.prefill_tokens
    sched.admit(GenerationRequest("short", short_prompt, params, outs["short"].append))
    joined_at = len(passes)
    sched.step()
    # its whole prompt (nothing cached), alone; the stats count a prompt's tokens but its last, as the batch does
    assert sched.stats.prefill_tokens - prefilled == len(short_prompt) - 1
    while sched.has_work:
        sched.step()
    assert all(len(run) <= 1 for run in passes)  # the long prompt's passes only
    assert first_at["short"] == joined_at < first_at["long"]  # no pass of the long one before it
    for name, tokens in (("long", long_prompt), ("short", short_prompt)):
        assert outs[name][-1].token_ids == greedy(make_generator(model, tokenizer, BS), tokens, 3)[0]


def test_the_servers_own_stack_assembles_a_hit_with_room_for_its_rest(tiny, tiny_model_dir, tmp_path, monkeypatch):
    """The engine as the server builds it (engine/build.py), not this file's harness: a hit's assembled
    arrays have room for the rest, so the question's prefill writes in place (growing copied the whole
    prefix: 0.1 s of the big-KV question's 0.6 s on this CPU), and the answer is the cold run's."""
    import threading

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import LoadedModel

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    model, tokenizer = tiny
    shapes: list[tuple[int, int, int]] = []  # (cached offset, buffer length before, after) per join
    real = direct_join.first_token

    def spy(model_, cache, tokens, start, *rest):
        before = (cache[0].offset, cache[0].keys.shape[2])
        out = real(model_, cache, tokens, start, *rest)
        shapes.append((*before, cache[0].keys.shape[2]))
        return out

    monkeypatch.setattr(direct_join, "first_token", spy)
    config = load_config(overrides={"ssd": {"enabled": False}, "speculative": {"mode": "off"}})
    engine = Engine(LoadedModel("tiny", tiny_model_dir, model, tokenizer, {}, 2048), config)
    engine.start()

    def ask(tokens: list[int]) -> Finished:
        done, events = threading.Event(), []
        params = SamplingParams(max_tokens=6, temperature=0.0)
        engine.submit(GenerationRequest(f"r{len(tokens)}", tokens, params, events.append, on_done=done.set))
        assert done.wait(120)
        return events[-1]

    try:
        base = prompt(tokenizer, "a lighthouse")
        ask(base + tokenizer.encode(" The end?"))
        question = base + tokenizer.encode(" And the keeper?")
        hit = ask(question)
    finally:
        engine.stop()
    assert hit.usage.cached_tokens >= len(base) // BS * BS
    (offset, length_before, length_after), *_ = shapes
    assert offset == hit.usage.cached_tokens and length_before >= len(question)  # room for the rest
    assert length_after == length_before  # written in place, not grown
    assert hit.token_ids == greedy(make_generator(model, tokenizer, BS), question, 6)[0]
