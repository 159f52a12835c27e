"""Continuous batching: requests run together give exactly what each gives alone (greedy), with
cached and uncached prompts mixed, different lengths, stop strings hitting at different steps,
requests joining a running batch, cancellation and failures that stay with their request."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
from kvharness import KVStack, make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.request import Failed, Finished, GenerationRequest, SamplingParams, TextDelta
from mlx_kvserve.engine.worker import InferenceWorker

BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


@dataclass
class Outcome:
    events: list

    @property
    def done(self):
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextDelta))

    def key(self):
        """What must not depend on the batch: tokens, text and finish reason."""
        assert isinstance(self.done, Finished), self.events
        return self.done.token_ids, self.text, self.done.finish_reason


def request(name: str, prompt: list[int], params: SamplingParams, outcome: Outcome, emit=None) -> GenerationRequest:
    return GenerationRequest(name, list(prompt), params, emit or outcome.events.append)


def alone(model, tokenizer, prompt, params) -> Outcome:
    """A cold run on a fresh engine: no cache, no other request."""
    out = Outcome([])
    make_generator(model, tokenizer, BS).run(request("alone", prompt, params, out))
    return out


def run_batch(gen: KVStack, jobs, join_after: dict[int, int] | None = None) -> list[Outcome]:
    """Run jobs [(prompt, params)] in one batch; job i joins after join_after[i] steps (default 0)."""
    join_after = join_after or {}
    outs = [Outcome([]) for _ in jobs]
    reqs = [request(f"r{i}", p, params, outs[i]) for i, (p, params) in enumerate(jobs)]
    pending = dict(enumerate(reqs))
    steps = 0
    while pending or gen.scheduler.num_running:
        for i in [i for i in pending if join_after.get(i, 0) <= steps]:
            gen.scheduler.admit(pending.pop(i))
        gen.scheduler.step()
        steps += 1
    return outs


def _prompts(tokenizer) -> list[list[int]]:
    text = " ".join(f"Note {i}: the orchard row {i} has {i * 5} apple trees by the old wall." for i in range(40))
    base = tokenizer.encode(text)
    other = tokenizer.encode(" ".join(f"Log {i}: the ferry left pier {i} at {i + 2} pm." for i in range(30)))
    return [base[: 5 * BS + 3], base[: 2 * BS + 9], other[: 3 * BS], other[:7], base[: 7 * BS + 1]]


def test_greedy_batch_equals_each_alone_cached_and_uncached(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    lengths = [24, 9, 17, 30, 12]
    # Stop strings cut 2 of the requests at different steps: taken from their own cold text.
    params = [SamplingParams(max_tokens=n) for n in lengths]
    cold = [alone(model, tokenizer, p, sp) for p, sp in zip(prompts, params, strict=True)]
    for i, cut in ((0, 10), (2, 4)):
        params[i] = SamplingParams(max_tokens=lengths[i], stop=(cold[i].text[cut : cut + 3],))
    expected = [alone(model, tokenizer, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert expected[0].done.finish_reason == "stop" and expected[2].done.finish_reason == "stop"
    assert len(expected[0].done.token_ids) != len(expected[2].done.token_ids)

    gen = make_generator(model, tokenizer, BS)
    warm = run_batch(gen, [(prompts[0][: 4 * BS + 2], SamplingParams(max_tokens=3)), (prompts[2], params[2])])
    assert warm[1].key() == expected[2].key()
    outs = run_batch(gen, list(zip(prompts, params, strict=True)), join_after={3: 2, 4: 5})
    for i, (got, want) in enumerate(zip(outs, expected, strict=True)):
        assert got.key() == want.key(), f"request {i}"
    cached = [o.done.usage.cached_tokens for o in outs]
    assert cached[0] >= 4 * BS and cached[2] == len(prompts[2]) - 1  # hits ...
    assert cached[3] == 0 and cached[4] >= 4 * BS  # ... and a cold one, in one batch
    manager = gen.prefix_cache.manager
    manager.check_integrity()
    assert manager.stats()["kv_in_use_blocks"] == 0


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    want = alone(model, tokenizer, prompts[1], seeded)
    again = alone(model, tokenizer, prompts[1], seeded)
    assert want.key() == again.key()
    other_seed = alone(model, tokenizer, prompts[1], SamplingParams(max_tokens=16, temperature=0.9, seed=99))
    assert other_seed.key() != want.key()  # the seed matters ...
    gen = make_generator(model, tokenizer, BS)
    jobs = [(prompts[0], SamplingParams(max_tokens=12, temperature=1.0)), (prompts[1], seeded)]
    outs = run_batch(gen, jobs + [(prompts[3], SamplingParams(max_tokens=20))])
    assert outs[1].key() == want.key()  # ... the batch does not


def test_cancelling_one_leaves_the_others_unchanged(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)[:3]
    params = SamplingParams(max_tokens=20)
    expected = [alone(model, tokenizer, p, params) for p in prompts]
    gen = make_generator(model, tokenizer, BS)
    outs = [Outcome([]) for _ in prompts]
    reqs = [request(f"r{i}", p, params, outs[i]) for i, p in enumerate(prompts)]
    for r in reqs:
        gen.scheduler.admit(r)
    for _ in range(8):  # prefill, then a few tokens each
        gen.scheduler.step()
    reqs[1].cancel()  # the client goes away (as the server does on a disconnect)
    gen.scheduler.step()
    assert not gen.scheduler.is_running(reqs[1])  # it left at the next step
    while gen.scheduler.num_running:
        gen.scheduler.step()
    assert outs[0].key() == expected[0].key() and outs[2].key() == expected[2].key()
    done = outs[1].done
    assert isinstance(done, Finished) and done.finish_reason == "cancelled"
    assert 3 <= len(done.token_ids) < len(expected[1].done.token_ids)
    assert done.token_ids == expected[1].done.token_ids[: len(done.token_ids)]
    gen.prefix_cache.manager.check_integrity()
    assert gen.prefix_cache.manager.stats()["kv_in_use_blocks"] == 0


def test_a_failing_request_fails_alone(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)[:4]
    params = SamplingParams(max_tokens=15)
    expected = [alone(model, tokenizer, p, params) for p in prompts]
    gen = make_generator(model, tokenizer, BS)
    cache = gen.prefix_cache
    prepare = cache.prepare

    def failing_prepare(tokens, *args):  # request 3's lookup breaks (a damaged tier, say)
        if tokens == prompts[3]:
            raise RuntimeError("lookup failed")
        return prepare(tokens, *args)

    cache.prepare = failing_prepare
    outs = [Outcome([]) for _ in prompts]
    reqs = [request(f"r{i}", p, params, outs[i]) for i, p in enumerate(prompts)]

    def broken_client(event):  # request 1's event sink breaks at its fourth token
        outs[1].events.append(event)
        if sum(isinstance(e, TextDelta) for e in outs[1].events) == 4:
            raise RuntimeError("client sink broke")

    reqs[1].emit = broken_client
    for r in reqs:
        gen.scheduler.admit(r)
    while gen.scheduler.num_running:
        gen.scheduler.step()
    assert outs[0].key() == expected[0].key() and outs[2].key() == expected[2].key()
    assert isinstance(outs[1].done, Failed) and "client sink broke" in str(outs[1].done.error)
    assert isinstance(outs[3].done, Failed) and "lookup failed" in str(outs[3].done.error)
    assert len(outs[3].events) == 1
    gen.prefix_cache.manager.check_integrity()
    assert gen.prefix_cache.manager.stats()["kv_in_use_blocks"] == 0
    cache.prepare = prepare  # the engine goes on serving
    assert run_batch(gen, [(prompts[3], params)])[0].key() == expected[3].key()


def test_worker_batches_at_most_max_batch(tiny):
    """Through the worker thread: 5 requests with max_batch = 2 all finish with their alone output,
    and never more than 2 run at once."""
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_tokens=10)
    expected = [alone(model, tokenizer, p, params) for p in prompts]
    gen = make_generator(model, tokenizer, BS)
    gen.scheduler.max_batch = 2
    worker = InferenceWorker(gen.scheduler, max_queue=8)
    outs = [Outcome([]) for _ in prompts]
    done = [threading.Event() for _ in prompts]
    peak = [0]
    step = gen.scheduler.step

    def counting_step():
        peak[0] = max(peak[0], gen.scheduler.num_started)
        step()

    gen.scheduler.step = counting_step
    for i, p in enumerate(prompts):
        req = request(f"r{i}", p, params, outs[i])
        req.on_done = done[i].set
        worker.submit(req)
    worker.start()
    try:
        assert all(d.wait(60) for d in done)
    finally:
        worker.stop(10)
    assert [o.key() for o in outs] == [e.key() for e in expected]
    assert peak[0] == 2
    assert not worker.is_busy and worker.queue_depth == 0


@pytest.mark.slow
def test_smollm_greedy_batch_equals_each_alone(smollm_dir):
    model, tokenizer = load(str(smollm_dir))
    system = "You are a terse assistant. Answer in one sentence. " * 8
    questions = ["What is the capital of France?", "Name a prime number above 50.", "Why is the sky blue?"]
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}]))
        for q in questions
    ]
    params = [SamplingParams(max_tokens=n) for n in (24, 12, 30)]
    expected = [alone(model, tokenizer, p, sp) for p, sp in zip(prompts, params, strict=True)]
    gen = make_generator(model, tokenizer, 32)
    run_batch(gen, [(prompts[0], params[0])])  # the shared system prompt is now cached
    outs = run_batch(gen, list(zip(prompts, params, strict=True)), join_after={2: 3})
    assert [o.key() for o in outs] == [e.key() for e in expected]
    assert all(o.done.usage.cached_tokens >= 32 for o in outs)


def test_shared_prefix_arriving_together_is_prefilled_once(tiny):
    """4 long prompts with one uncached prefix, admitted in the same step: prefilling together (4 prefill
    slots), the first prefills the prefix, the others wait for its blocks and look up again; one at a
    time (the default), the others start after it as hits. Either way the engine's prefill-token counter
    shows the prefix prefilled once, and every output is still the alone one."""
    model, tokenizer = tiny
    text = " ".join(f"Rule {i}: a visitor to room {i} signs the book at desk {i * 2}." for i in range(40))
    shared = tokenizer.encode(text)[: 16 * BS]
    identical = [shared + tokenizer.encode(" Question: who signs?")] * 4
    different = [shared + tokenizer.encode(f" Question {q}: which desk is for room {q}?") for q in range(4)]
    params = SamplingParams(max_tokens=8)
    for prompts, slots in ((identical, 4), (different, 4), (different, 0)):
        expected = [alone(model, tokenizer, p, params) for p in prompts]
        gen = make_generator(model, tokenizer, BS)
        gen.scheduler.prefill_batch_size = slots or gen.scheduler.prefill_batch_size
        outs = run_batch(gen, [(p, params) for p in prompts])
        assert [o.key() for o in outs] == [e.key() for e in expected]
        stats = gen.scheduler.stats
        assert stats.shared_prefix_waits == (3 if slots else 0)
        suffixes = sum(len(p) - len(shared) for p in prompts)
        assert stats.prefill_tokens <= len(shared) + suffixes + 3 * BS < 2 * len(shared)  # not 4 x shared
        assert all(o.done.usage.cached_tokens >= len(shared) for o in outs[1:])
        gen.prefix_cache.manager.check_integrity()


def test_pick_leader_prefers_the_longest_uncached_share():
    from mlx_kvserve.engine.batch.prefix_waits import pick_leader
    from mlx_kvserve.engine.cache.prefix_cache import leading_blocks

    mine = [b"a", b"b", b"c", b"d"]
    prefilling = {1: [b"a", b"x"], 2: [b"a", b"b", b"c"], 3: [b"z"]}
    assert pick_leader(mine, prefilling, 0) == 2
    assert pick_leader(mine, prefilling, 3) is None  # the cache already holds what 2 would add
    assert pick_leader(mine, {}, 0) is None
    assert leading_blocks(mine, {b"a", b"b"}.__contains__) == 2


def test_logprobs_on_events(tiny):
    model, tokenizer = tiny
    prompt = _prompts(tokenizer)[1]
    plain = alone(model, tokenizer, prompt, SamplingParams(max_tokens=10))
    out = alone(model, tokenizer, prompt, SamplingParams(max_tokens=10, top_logprobs=3))
    assert out.key() == plain.key()
    entries = [lp for e in out.events if isinstance(e, TextDelta) for lp in e.logprobs]
    assert [lp.token for lp in entries] == list(out.done.token_ids)  # one per sampled token
    for lp in entries:
        assert len(lp.top) == 3 and lp.logprob <= 0
        assert lp.top[0] == (lp.token, pytest.approx(lp.logprob))  # greedy took the most likely
        assert [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)
    assert all(not e.logprobs for e in plain.events if isinstance(e, TextDelta))  # only when asked


def test_health_and_metrics_show_the_batch(tiny, tiny_model_dir, tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import LoadedModel
    from mlx_kvserve.server.app import create_app

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    model, tokenizer = tiny
    config = load_config(overrides={"server": {"max_batch": 4}, "ssd": {"enabled": False}})
    engine = Engine(LoadedModel("tiny", tiny_model_dir, model, tokenizer, {}, 2048), config)
    seen: list[dict] = []
    done = threading.Event()

    def emit(event):  # on the worker thread, while the request is in the batch
        if isinstance(event, TextDelta) and not seen:
            seen.append(engine.batch_stats())
        if isinstance(event, Finished):
            done.set()

    with TestClient(create_app(engine)) as client:
        engine.submit(GenerationRequest("r", _prompts(tokenizer)[0], SamplingParams(max_tokens=12), emit))
        assert done.wait(30)
        deadline = time.monotonic() + 10  # Finished is sent before the blocks are registered
        while engine.worker.is_busy and time.monotonic() < deadline:
            time.sleep(0.01)
        body = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert seen[0]["running"] == 1 and seen[0]["batch_size"] == 1 and seen[0]["max_batch"] == 4
    batch = body["batch"]
    assert batch["running"] == 0 and batch["waiting"] == 0 and batch["batch_size"] == 0
    assert batch["prefill_tokens"] >= len(_prompts(tokenizer)[0]) - 1 and batch["prefill_tokens_per_s"] > 0
    assert batch["decode_tokens"] >= 11 and batch["decode_tokens_per_s"] > 0
    for name in ("requests_running 0.0", "batch_size 0.0", "decode_tokens_total", "prefill_seconds_total"):
        assert f"mlx_kvserve_{name}" in metrics, name


def test_prompt_blocks_are_registered_once_prefill_is_done(tiny, tmp_path):
    """While a long generation still runs, its prompt's blocks already serve a new request (from RAM);
    they reach the SSD only when the first request ends."""
    model, tokenizer = tiny
    prompt = _prompts(tokenizer)[4]
    gen = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    first = Outcome([])
    req = request("long", prompt, SamplingParams(max_tokens=40), first)
    gen.scheduler.admit(req)
    while not any(isinstance(e, TextDelta) for e in first.events):
        gen.scheduler.step()
    gen.scheduler.step()  # registration follows the first token
    assert gen.scheduler.is_running(req)
    manager = gen.prefix_cache.manager
    assert manager.stats()["kv_ram_blocks"] == len(prompt) // BS
    second = Outcome([])
    gen.scheduler.admit(request("second", prompt, SamplingParams(max_tokens=4), second))
    while not second.events or not isinstance(second.done, Finished):
        gen.scheduler.step()
    assert second.done.usage.cached_tokens == len(prompt) - 1  # blocks and the prompt's tail
    store = gen.prefix_cache.ssd_tier.store
    assert gen.scheduler.is_running(req) and store.stats()["ssd_blocks"] == 0  # not written yet
    while gen.scheduler.num_running:
        gen.scheduler.step()
    assert gen.prefix_cache.ssd_tier.close(drain_timeout_s=30)
    assert store.stats()["ssd_blocks"] == manager.stats()["kv_ram_blocks"] >= len(prompt) // BS
    manager.check_integrity()


def test_a_failing_batch_step_fails_its_requests_and_the_engine_goes_on(tiny):
    model, tokenizer = tiny
    prompts = [_prompts(tokenizer)[i] for i in (0, 2)]  # no shared prefix: both go into the batch
    params = SamplingParams(max_tokens=6)
    gen = make_generator(model, tokenizer, BS)
    outs = [Outcome([]) for _ in prompts]
    for i, p in enumerate(prompts):
        gen.scheduler.admit(request(f"r{i}", p, params, outs[i]))
    gen.scheduler.step()
    batch = gen.scheduler._batch
    batch.next = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))  # the forward pass fails
    gen.scheduler.step()
    assert all(isinstance(o.done, Failed) and "device lost" in str(o.done.error) for o in outs)
    assert gen.scheduler.num_running == 0 and gen.prefix_cache.manager.stats()["kv_in_use_blocks"] == 0
    again = run_batch(gen, [(prompts[0], params)])[0]
    assert again.key() == alone(model, tokenizer, prompts[0], params).key()


def test_max_batch_config():
    from mlx_kvserve.config import load_config
    from mlx_kvserve.errors import ConfigError

    assert load_config().server.batch_limit() == 16
    assert load_config(overrides={"server": {"max_queue": 1}}).server.batch_limit() == 1  # one at a time
    assert load_config(overrides={"server": {"max_batch": 32, "max_queue": 64}}).server.batch_limit() == 32
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"server": {"max_batch": 0}})
    assert info.value.param == "server.max_batch"


def test_a_flush_during_a_request_drops_its_deferred_blocks(tiny, tmp_path):
    """Prompt blocks registered early (SSD write deferred) and then flushed while the request still
    runs are not written to the SSD when it ends: the flush wins."""
    model, tokenizer = tiny
    prompt = _prompts(tokenizer)[4]
    gen = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    out = Outcome([])
    req = request("long", prompt, SamplingParams(max_tokens=12), out)
    gen.scheduler.admit(req)
    manager = gen.prefix_cache.manager
    while manager.stats()["kv_ram_blocks"] == 0:
        gen.scheduler.step()
    assert manager.flush()["ram_dropped"] == len(prompt) // BS
    while gen.scheduler.num_running:
        gen.scheduler.step()
    tier = gen.prefix_cache.ssd_tier
    assert tier.close(drain_timeout_s=30)
    assert tier.store.stats()["ssd_blocks"] == manager.stats()["kv_ram_blocks"]  # only blocks made after it
    assert run_batch(gen, [(prompt, SamplingParams(max_tokens=2))])[0].done.usage.cached_tokens == 0


def test_a_finished_reply_finds_its_blocks_cached(tiny):
    """Finished is sent after the KV is registered: a client holding its whole reply (then sending a
    flush or a repeat) never races the registration."""
    model, tokenizer = tiny
    gen = make_generator(model, tokenizer, BS)
    manager = gen.prefix_cache.manager
    prompt = list(range(3, 3 + 3 * BS + 5))
    seen: list[int] = []

    def emit(ev):
        if isinstance(ev, Finished):  # on the worker thread, as the server's queue would get it
            match = manager.lookup(prompt + list(ev.token_ids))
            seen.append(match.num_tokens)
            manager.release(match.blocks)

    gen.run(GenerationRequest("r", prompt, SamplingParams(max_tokens=4, temperature=0.0), emit))
    # Not only the prompt's full blocks (registered after the first token) but its tail and the
    # generated tokens, which are registered when the request ends.
    assert seen and seen[0] > len(prompt), seen
