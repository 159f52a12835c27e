"""Draft-model speculation (engine/speculative/draft.py) and sampled acceptance (engine/speculative/acceptance.py):
greedy output with a draft model is the plain output token for token, with a draft that always
agrees (SmolLM2 drafting for itself) and one that never does (a tiny random llama with SmolLM2's
vocabulary), alone and with a cache hit (the draft's prompt KV comes from its own blocks); a seeded
sampled request gives the same tokens with speculation on or off; the speculative-sampling rule
keeps the target's distribution."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from harness.synthetic import family_config, random_model
from kvharness import make_generator
from mlx_lm.utils import load
from tinymodel import llama_config, random_llama

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.engine.sampling.sampler import make_request_sampler
from mlx_kvserve.engine.speculative.acceptance import Acceptance, KeyChain, resumed_sampler, standard_rule
from mlx_kvserve.engine.speculative.draft import DraftModel, check_compatible, draft_block_cache
from mlx_kvserve.engine.speculative.speculator import DRAFT, Speculator
from mlx_kvserve.errors import ConfigError

BS = 16
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return load(str(smollm_dir))


@pytest.fixture(scope="module")
def bad_draft(smollm):
    """A tiny random llama scoring SmolLM2's vocabulary: its drafts are almost never right."""
    model, _ = smollm
    return random_llama(llama_config(vocab_size=model.args.vocab_size), seed=3, scale=4.0)


@pytest.fixture(scope="module")
def plain(smollm):
    """The plain outputs (speculation off) for GREEDY and SEEDED."""
    model, tokenizer = smollm
    gen = generator(model, tokenizer, mode="off")
    return {params: run(gen, prompt_of(tokenizer), params).token_ids for params in (GREEDY, SEEDED)}


def draft_of(model) -> DraftModel:
    return DraftModel(model, "draft", draft_block_cache(model, "draft-fp", BS, 1 << 28), prefill_step=64)


def generator(model, tokenizer, draft=None, mode="auto"):
    """A Generator speculating at full depth wherever it can (None: speculation off)."""
    gen = make_generator(model, tokenizer, BS)
    if mode != "off":
        spec = Speculator(model, set(tokenizer.eos_token_ids), mode, 4, draft)
        spec.refuse_layout(gen.prefix_cache.layout)
        for depth in spec.depths.values():
            depth.choose = lambda accepted, rejected, depth=depth: depth.max_depth
        gen.scheduler.speculation = spec
    return gen


def run(gen, prompt, params) -> Finished:
    events: list = []
    gen.run(GenerationRequest("r", list(prompt), params, events.append))
    assert isinstance(events[-1], Finished), events
    return events[-1]


def prompt_of(tokenizer) -> list[int]:
    code = "\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(6))
    return tokenizer.encode(f"Copy this code exactly:\n{code}\nCopy:\n{code[:60]}")


def test_greedy_draft_model_output_equals_plain_alone_and_cached(smollm, bad_draft, plain):
    model, tokenizer = smollm
    prompt, params, want = prompt_of(tokenizer), GREEDY, plain[GREEDY]
    for draft, rate in ((model, 0.95), (bad_draft, None)):
        gen = generator(model, tokenizer, draft_of(draft))
        cold, hit = run(gen, prompt, params), run(gen, prompt, params)
        assert cold.token_ids == want and hit.token_ids == want
        s = gen.scheduler.speculation.stats
        assert s.solo_requests == 2 and s.drafted_tokens > 0
        assert hit.usage.cached_tokens > 0 and s.draft_cached_tokens > 0  # the second skipped both prefills
        if rate is not None:  # SmolLM2 drafting for itself: it agrees with itself
            assert s.accepted_tokens >= rate * s.drafted_tokens
        else:
            assert s.accepted_tokens <= 0.2 * s.drafted_tokens


def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_and_off(smollm, plain):
    model, tokenizer = smollm
    prompt, params, want = prompt_of(tokenizer), SEEDED, plain[SEEDED]
    lookup = generator(model, tokenizer, mode="prompt_lookup")
    assert run(lookup, prompt, params).token_ids == want
    drafted = generator(model, tokenizer, draft_of(model))
    assert run(drafted, prompt, params).token_ids == want
    s = drafted.scheduler.speculation.stats
    assert s.accepted_tokens >= 0.9 * s.drafted_tokens > 0  # shared keys: the same model draws alike


def test_unseeded_sampling_with_a_self_draft_accepts_every_draft(smollm):
    model, tokenizer = smollm
    gen = generator(model, tokenizer, draft_of(model))
    done = run(gen, prompt_of(tokenizer), SamplingParams(max_tokens=12, temperature=1.0))
    s = gen.scheduler.speculation.stats
    assert done.usage.completion_tokens > 0 and s.drafted_tokens > 0
    assert s.accepted_tokens >= 0.9 * s.drafted_tokens  # p_target = p_draft: min(1, p/q) = 1 (up to float noise)


def test_seeded_request_rejoining_the_batch_keeps_its_key_chain(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    first, second = tokenizer.encode("abcabcabcabcabcabc abc abc"), tokenizer.encode("the other one")
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=11)
    want = run(generator(model, tokenizer, mode="off"), first, params).token_ids
    gen = generator(model, tokenizer, mode="prompt_lookup")
    sched, events = gen.scheduler, []
    sched.admit(GenerationRequest("a", first, params, events.append))
    steps = 0
    while sched.has_work:
        if steps == 6:
            assert sched.speculation.solo is not None
            sched.admit(GenerationRequest("b", second, SamplingParams(max_tokens=5), lambda e: None))
        sched.step()
        steps += 1
    assert events[-1].token_ids == want and sched.speculation.stats.rejoins == 1


def test_draft_cache_follows_the_kept_tokens(tiny_model_dir):
    """After a verify pass kept one draft of three and replaced the next, the draft's cache holds
    exactly the kept sequence: its next drafts equal those of a draft prefilled afresh."""
    model, tokenizer = load(str(tiny_model_dir))
    draft, greedy = draft_of(model), Acceptance(SamplingParams(max_tokens=8), 0)
    seq = tokenizer.encode("abcabcab")
    run_ = draft.open(seq[:4], seq)
    drafts = run_.propose(seq, 3, greedy).tolist()
    kept = [*seq, drafts[0], (drafts[1] + 1) % 200]
    run_.settle(drafts, kept)
    assert run_.fed == kept[:-1] and run_.cache[0].offset == len(kept) - 1
    fresh = DraftModel(model, "fresh").open(seq[:4], kept)
    assert run_.propose(kept, 4, greedy).tolist() == fresh.propose(kept, 4, greedy).tolist()
    run_.close()


def test_key_chain_matches_the_batch_samplers_draws():
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=5)
    rows = mx.random.normal((6, 1, 32), key=mx.random.key(0))
    batch = make_request_sampler(params)
    drawn = [batch(rows[i]).item() for i in range(6)]
    acceptance = Acceptance(params, 2)  # a request that goes solo after two tokens
    got = acceptance.verify(mx.concatenate(list(rows[2:5])), [drawn[2], drawn[3]])
    assert got.tokens == drawn[2:5] and got.accepted == 2
    acceptance.advance(3)
    assert acceptance.verify(rows[5], []).tokens == [drawn[5]]
    resumed = resumed_sampler(params, 4)
    assert [resumed(rows[i]).item() for i in (4, 5)] == drawn[4:]
    assert KeyChain(5, 3).draws(1)[0].tolist() == KeyChain(5, 2).draws(2)[1].tolist()


def test_standard_rule_keeps_the_target_distribution():
    """Over a 4-token vocabulary, tokens at positions 0 and 1 follow the target's rows, whatever the draft's."""
    mx.random.seed(1)
    target = mx.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    drafted = mx.array([[0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    rng = np.random.default_rng(0)
    n = 1500
    first, second = np.zeros(4), np.zeros(4)
    for _ in range(n):
        draft = [int(rng.choice(4, p=np.array(drafted[i]))) for i in range(2)]
        verdict = standard_rule(target, drafted, draft)
        first[verdict.tokens[0]] += 1
        if len(verdict.tokens) > 1:
            second[verdict.tokens[1]] += 1
    assert np.abs(first / n - np.array(target[0])).max() < 0.05
    assert np.abs(second / second.sum() - np.array(target[1])).max() < 0.08


def test_draft_with_another_tokenizer_or_a_recurrent_layout_is_refused(smollm, tiny_model_dir):
    _, tokenizer = smollm
    _, byte_tokenizer = load(str(tiny_model_dir))
    check_compatible(tokenizer, tokenizer, "same")
    with pytest.raises(ConfigError, match="must share the served model's tokenizer"):
        check_compatible(tokenizer, byte_tokenizer, "tiny")
    qwen = random_model(family_config("qwen3_5"))
    with pytest.raises(ConfigError, match="cannot be rewound"):
        DraftModel(qwen, "qwen")
    # A qwen3_5 served model refuses speculation with a draft model as with prompt lookup.
    gen = make_generator(qwen, byte_tokenizer, BS)
    spec = Speculator(qwen, {0}, "auto", 4, draft=object())
    spec.refuse_layout(gen.prefix_cache.layout)
    assert "recurrent" in spec.refused and not spec.wants(SamplingParams(max_tokens=4))


def test_modes_pick_the_drafter():
    with_draft = Speculator(None, {0}, "auto", 4, draft=object())
    assert with_draft.kind(SamplingParams(max_tokens=4)) == DRAFT
    assert with_draft.kind(SamplingParams(max_tokens=4, speculative="prompt_lookup")) == "prompt_lookup"
    without = Speculator(None, {0}, "auto", 4)
    assert without.kind(SamplingParams(max_tokens=4)) == "prompt_lookup"
    assert not without.wants(SamplingParams(max_tokens=4, speculative="draft"))  # no draft model loaded
    assert without.wants(SamplingParams(max_tokens=4, temperature=0.7, seed=3))


def test_config_draft_mode_needs_a_draft_model():
    from mlx_kvserve.config import load_config

    with pytest.raises(ConfigError, match="draft_model"):
        load_config(overrides={"speculative": {"mode": "draft"}})
    config = load_config(overrides={"speculative": {"mode": "draft", "draft_model": "/m"}})
    assert config.speculative.draft_model == "/m"


def test_constrained_drafts_are_checked_against_the_grammar(smollm):
    """A json_schema request speculates (drafts checked by its matcher) and gives the plain tokens,
    by prompt lookup alone, and with a draft model going back into the batch mid-way."""
    model, tokenizer = smollm
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"],
    }
    record = '{"name": "Ada Lovelace", "city": "London"}'
    prompt = tokenizer.encode(f"Record: {record}\nThe same record as JSON: {record}\nAgain, as JSON:")
    params = SamplingParams(max_tokens=MAX_TOKENS, json_schema=schema)
    want = run(generator(model, tokenizer, mode="off"), prompt, params).token_ids
    for draft in (None, draft_of(model)):
        gen = generator(model, tokenizer, draft)
        gen.scheduler.speculation.tokenizer = tokenizer
        sched, events = gen.scheduler, []
        sched.admit(GenerationRequest("a", prompt, params, events.append))
        steps = 0
        while sched.has_work:
            if steps == 4 and draft is not None:
                assert sched.speculation.solo is not None
                sched.admit(
                    GenerationRequest("b", tokenizer.encode("Hi"), SamplingParams(max_tokens=3), lambda e: None)
                )
            sched.step()
            steps += 1
        assert events[-1].token_ids == want
        s = sched.speculation.stats
        assert s.drafted_tokens > 0 and s.accepted_tokens > 0 and s.rejoins == (draft is not None)


def test_load_draft_from_the_config(smollm, smollm_dir, tiny_model_dir, tmp_path, monkeypatch):
    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.speculative.draft import load_draft

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    _, tokenizer = smollm
    assert load_draft(load_config(), tokenizer, 512) is None
    draft = load_draft(load_config(overrides={"speculative": {"draft_model": str(smollm_dir)}}), tokenizer, 512)
    assert draft.name == smollm_dir.name and draft.prefix_cache is not None


def test_a_draft_that_does_not_fit_is_skipped_under_auto_and_refused_under_draft(
    smollm, tiny_model_dir, tmp_path, monkeypatch
):
    """Several [[models]] share one [speculative] draft_model: under "auto" a model whose tokenizer
    the draft does not share drafts by prompt lookup instead of failing to load; "draft" refuses."""
    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.speculative.draft import load_draft

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    _, tokenizer = smollm

    def config(mode: str):
        return load_config(
            overrides={
                "speculative": {"mode": mode, "draft_model": str(tiny_model_dir)},
                "model": {"models_dir": str(tmp_path)},
            }
        )

    assert load_draft(config("auto"), tokenizer, 512) is None
    with pytest.raises(ConfigError, match="must share the served model's tokenizer"):
        load_draft(config("draft"), tokenizer, 512)
