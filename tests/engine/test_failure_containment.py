"""A failure stays with the request that caused it (issue 23, bug 1). mlx-lm compiles its sampling
filters with MLX's global PRNG state as input and output: one that raises while being traced (top_k at
or above the vocabulary) left that state a placeholder without a primitive, failed every request in
the batch, and then every unseeded sampled request until a restart. Now the sampler's failure fails
its request alone, the batch goes on unchanged, and the engine serves sampled, seeded and greedy
requests as before."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvharness import make_generator
from mlx_lm.sample_utils import apply_top_k
from mlx_lm.utils import load

import mlx_kvserve.engine.batch.scheduler as scheduler_module
from mlx_kvserve.engine.request import Failed, Finished, GenerationRequest, SamplingParams
from mlx_kvserve.engine.sampling.sampler import make_request_sampler

BS = 16
FAULTY_SEED = 666  # the request whose sampler breaks mid-reply
GREEDY = SamplingParams(max_tokens=12)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, min_p=0.05, seed=1234)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def prompts(tokenizer) -> list[list[int]]:
    text = " ".join(f"Ledger {i}: crate {i} holds {i * 3} jars of plum jam from the hill farm." for i in range(20))
    tokens = tokenizer.encode(text)
    return [tokens[: 3 * BS + 5], tokens[-(2 * BS + 7) :], tokens[40 : 40 + BS + 3], tokens[90:100]]


def break_random_state(logprobs: mx.array) -> None:
    """What a compiled mlx-lm filter does when it raises: it is traced, raises, and leaves MLX's
    global PRNG state a placeholder (here: top_k equal to the vocabulary)."""
    apply_top_k(logprobs, logprobs.shape[-1])


def run(gen, jobs: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Run jobs [(prompt, params)] together in one batch; each job's events."""
    events: list[list] = [[] for _ in jobs]
    for i, (prompt, params) in enumerate(jobs):
        gen.scheduler.admit(GenerationRequest(f"r{i}", list(prompt), params, events[i].append))
    while gen.scheduler.num_running:
        gen.scheduler.step()
    return events


def finished(events: list) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def alone(model, tokenizer, prompt: list[int], params: SamplingParams) -> tuple[int, ...]:
    return finished(run(make_generator(model, tokenizer, BS), [(prompt, params)])[0]).token_ids


def check_serves_everything(gen, model, tokenizer, ps: list[list[int]]) -> None:
    """Sampled (no seed), seeded and greedy requests all finish, the deterministic ones as alone."""
    outs = run(gen, [(ps[0], SAMPLED), (ps[1], SEEDED), (ps[2], GREEDY), (ps[3], SAMPLED)])
    assert all(len(finished(e).token_ids) > 0 for e in outs)
    assert finished(outs[1]).token_ids == alone(model, tokenizer, ps[1], SEEDED)
    assert finished(outs[2]).token_ids == alone(model, tokenizer, ps[2], GREEDY)
    manager = gen.prefix_cache.manager
    manager.check_integrity()
    assert manager.stats()["kv_in_use_blocks"] == 0


def test_a_sampler_failing_mid_batch_fails_its_request_alone(tiny, monkeypatch):
    model, tokenizer = tiny
    ps = prompts(tokenizer)

    def sampler_for(params: SamplingParams):
        sampler, calls = make_request_sampler(params), [0]
        if params.seed != FAULTY_SEED:
            return sampler

        def breaks_at_its_fifth_token(logprobs: mx.array) -> mx.array:
            calls[0] += 1
            if calls[0] == 5:
                break_random_state(logprobs)
            return sampler(logprobs)

        return breaks_at_its_fifth_token

    monkeypatch.setattr(scheduler_module, "make_request_sampler", sampler_for)
    gen = make_generator(model, tokenizer, BS)
    faulty = SamplingParams(max_tokens=12, temperature=0.9, seed=FAULTY_SEED)
    outs = run(gen, [(ps[0], GREEDY), (ps[1], faulty), (ps[2], SEEDED), (ps[3], SAMPLED)])
    assert isinstance(outs[1][-1], Failed) and "top_k" in str(outs[1][-1].error)
    assert finished(outs[0]).token_ids == alone(model, tokenizer, ps[0], GREEDY)
    assert finished(outs[2]).token_ids == alone(model, tokenizer, ps[2], SEEDED)
    assert len(finished(outs[3]).token_ids) > 0
    check_serves_everything(gen, model, tokenizer, ps)


def test_a_failed_batch_step_leaves_sampling_working(tiny):
    model, tokenizer = tiny
    ps = prompts(tokenizer)
    gen = make_generator(model, tokenizer, BS)
    outs: list[list] = [[], []]
    for i, params in enumerate((SAMPLED, GREEDY)):
        gen.scheduler.admit(GenerationRequest(f"r{i}", ps[i], params, outs[i].append))
    gen.scheduler.step()

    def broken_step():  # the whole step fails, after breaking the PRNG state on its way
        break_random_state(mx.zeros((1, 8)))

    gen.scheduler._batch.next = broken_step
    gen.scheduler.step()
    assert all(isinstance(o[-1], Failed) and "top_k" in str(o[-1].error) for o in outs)
    check_serves_everything(gen, model, tokenizer, ps)


@pytest.mark.parametrize("seed", [None, 7])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(seed):
    logprobs = mx.log(mx.softmax(mx.arange(8, dtype=mx.float32).reshape(1, 8), axis=-1))
    for top_k in (8, 9, 2**31):
        sampler = make_request_sampler(SamplingParams(max_tokens=1, temperature=1.0, top_k=top_k, seed=seed))
        token = sampler(logprobs).item()
        assert 0 <= token < 8
    mx.eval(mx.random.uniform(shape=(2,)))  # the global PRNG state still works
