"""Every model family mlx-lm runs gets its prefixes cached: sliding-window layers (blocks holding
what was inside a window), recurrent layers (checkpoints), and mixes of them. A hit must give
exactly the greedy tokens (and allclose logits) of a cold run, from RAM, from the SSD after a
restart, and batched. Never weaken these tests."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from familymodels import build_family_model
from kvharness import close_ssd, cold_logits, final_logits, greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.kv import blocks
from mlx_kvserve.kv.hashing import namespace_hash

FAMILIES = ["qwen3_5", "gemma3_text", "gpt_oss", "nemotron_h", "lfm2", "mamba2"]
BS = 16  # block size; the tiny windows are 24 positions
EVERY = 64  # checkpoint every 64 tokens: checkpoints at 64, 128 and 149 (= len(p1) - 1)
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = build_family_model(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = load(str(folder))
    return request.param, model, tokenizer


def _prompts(tokenizer) -> dict[str, list[int]]:
    base = tokenizer.encode(" ".join(f"Fact {i}: river {i} flows to town {i * 7}." for i in range(30)))
    other = tokenizer.encode(" Then something else entirely was said by the old man.")
    assert len(base) > 200
    return {
        "warm": base[:150],
        "repeat": base[:150],  # checkpoint at 149
        "on": base[:128] + other,  # shares exactly up to the checkpoint at 128
        "before": base[:127] + other,  # one short of it: back to the one at 64
        "after": base[:129] + other,  # one past it
        "far": base[:100] + other,  # window models: the window before 96 is one position short
    }


# Cached tokens each prompt gets after "warm". Recurrent models: the checkpoint positions. Window
# models: any prefix whose last W positions some capture held (a capture holds the W - 1 positions
# before a prefill chunk plus the chunk: 23 + 32 here) — "before" uses 15 of the tail ending at 128,
# "far" finds 96 one position short (23 of 24) and goes back to 64.
EXPECTED = {"repeat": 149, "on": 128, "before": 64, "after": 128, "far": 64}
EXPECTED_WINDOW = {**EXPECTED, "before": 127}
STEP = 32  # prefill chunk of the warm runs (cold runs use 512: a hit must not depend on chunking)


def _expected(name: str) -> dict[str, int]:
    return EXPECTED_WINDOW if name in ("gemma3_text", "gpt_oss") else EXPECTED


def _cold(model, tokenizer, prompt):
    return greedy(make_generator(model, tokenizer, BS), prompt, MAX_TOKENS)


def test_layout_is_not_plain(family):
    name, model, _ = family
    layout = blocks.cache_layout(model, BS)
    assert layout.supported and layout.needs_checkpoints and layout.signature
    assert layout.has_state == (name not in ("gemma3_text", "gpt_oss"))
    assert layout.has_window == (name in ("gemma3_text", "gpt_oss"))
    # The layout is part of the namespace: a cache written for one layout is never read for another.
    plain = namespace_hash("m", "float32", BS)
    assert namespace_hash("m", "float32", BS, cache_layout=layout.signature) != plain
    assert namespace_hash("m", "float32", BS, cache_layout="") == plain  # plain models keep their caches


def test_hits_equal_cold_from_ram_and_from_ssd_after_restart(family, tmp_path):
    name, model, tokenizer = family
    prompts = _prompts(tokenizer)
    cold = {k: _cold(model, tokenizer, p) for k, p in prompts.items() if k != "warm"}

    warm = make_generator(model, tokenizer, BS, checkpoint_every=EVERY, prefill_step_size=STEP)
    greedy(warm, prompts["warm"], MAX_TOKENS)
    for key, expect in _expected(name).items():
        logits, cached_for_logits = final_logits(warm, prompts[key])
        ids, text, cached = greedy(warm, prompts[key], MAX_TOKENS)
        assert (ids, text) == cold[key][:2], f"{name} {key}: RAM hit differs from cold"
        assert cached == cached_for_logits == expect, f"{name} {key}: {cached} cached"
        reference = cold_logits(model, prompts[key])
        assert mx.allclose(logits, reference, atol=1e-3, rtol=1e-3).item(), f"{name} {key} logits"
    warm.prefix_cache.manager.check_integrity()

    # The SSD: only the warm-up before the restart, so each prompt finds just its checkpoints there.
    first_run = make_generator(
        model, tokenizer, BS, ssd_dir=tmp_path / "ssd", checkpoint_every=EVERY, prefill_step_size=STEP
    )
    greedy(first_run, prompts["warm"], MAX_TOKENS)
    assert close_ssd(first_run)
    for key, expect in _expected(name).items():
        shutil.copytree(tmp_path / "ssd", tmp_path / key)  # each restart sees the same files
        restarted = make_generator(model, tokenizer, BS, ssd_dir=tmp_path / key, checkpoint_every=EVERY)
        ids, text, cached = greedy(restarted, prompts[key], MAX_TOKENS)
        assert (ids, text) == cold[key][:2], f"{name} {key}: SSD hit differs from cold"
        assert cached == expect, f"{name} {key}: {cached} cached from the SSD"
        restarted.prefix_cache.manager.check_integrity()
        stats = restarted.prefix_cache.ssd_tier.tails.stats
        assert stats["ssd_tail_hits"] + restarted.prefix_cache.ssd_tier.stats()["ssd_hits"] >= 1
        assert stats["ssd_tail_errors"] == 0
        assert close_ssd(restarted)


def test_second_turn_extending_the_reply_hits_it_all(family):
    name, model, tokenizer = family
    first = _prompts(tokenizer)["warm"]
    warm = make_generator(model, tokenizer, BS, checkpoint_every=EVERY)
    reply, _, _ = greedy(warm, first, MAX_TOKENS)
    second = first + list(reply) + tokenizer.encode(" And the next question?")
    ids, text, cached = greedy(warm, second, MAX_TOKENS)
    assert (ids, text) == _cold(model, tokenizer, second)[:2], name
    assert cached == len(first) + len(reply), f"{name}: {cached} cached, the first turn had {len(first) + len(reply)}"


def test_batched_hits_equal_cold(family):
    """Requests run together in one batch, each starting from its own checkpoint."""
    name, model, tokenizer = family
    prompts = _prompts(tokenizer)
    keys = ["repeat", "before", "after", "far"]
    cold = {k: _cold(model, tokenizer, prompts[k]) for k in keys}
    gen = make_generator(model, tokenizer, BS, checkpoint_every=EVERY, prefill_step_size=STEP)
    greedy(gen, prompts["warm"], MAX_TOKENS)
    events: dict[str, list] = {k: [] for k in keys}
    reqs = [
        GenerationRequest(k, list(prompts[k]), SamplingParams(max_tokens=MAX_TOKENS), events[k].append) for k in keys
    ]
    for req in reqs:
        gen.scheduler.admit(req)
    steps = 0
    while any(gen.scheduler.is_running(r) for r in reqs):
        gen.scheduler.step()
        steps += 1
    assert gen.scheduler.stats.steps >= steps > 0
    for k in keys:
        done = events[k][-1]
        assert isinstance(done, Finished), events[k]
        assert done.token_ids == cold[k][0], f"{name} {k}: batched hit differs from cold"
        assert done.usage.cached_tokens == _expected(name)[k], f"{name} {k}"
    gen.prefix_cache.manager.check_integrity()
