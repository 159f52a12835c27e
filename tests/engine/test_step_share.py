"""Prompts prefilling together share one batch step's `prefill_step_size` tokens (engine/batch/mlx_batch.py,
`generation.prefill_step_shared`): with mlx-lm's step each of n cold prompts prefills a whole chunk, so a
step (during which no running request gets a token) is n chunks long. Shared, every pass stays within one
chunk, and each prompt still gets the tokens it gets alone."""

from __future__ import annotations

import pytest
from kvharness import greedy, make_generator
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.utils import load

from mlx_kvserve.engine.batch.mlx_batch import MIN_SHARE
from mlx_kvserve.engine.request import GenerationRequest, SamplingParams

BS, STEP = 16, 128


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def prompts(tokenizer) -> list[list[int]]:
    topics = ("a lighthouse", "a glacier", "a desert road", "an orchard")
    return [
        tokenizer.encode(f"Write a long story about {t}, with many details. " * (10 + i)) for i, t in enumerate(topics)
    ]


def run_together(model, tokenizer, share: bool, monkeypatch) -> tuple[list[int], list[tuple[int, ...]]]:
    """(prompt tokens of each prefill pass, each request's greedy tokens), four cold prompts at once."""
    gen = make_generator(model, tokenizer, BS, prefill_step_size=STEP)
    gen.scheduler.share_prefill_step = share
    gen.scheduler.prefill_batch_size = 4  # the four cold prompts prefill together (the default is one at a time)
    passes: list[int] = []
    real = PromptProcessingBatch.prompt

    def counted(self, tokens):
        passes.append(sum(len(t) for t in tokens))
        return real(self, tokens)

    monkeypatch.setattr(PromptProcessingBatch, "prompt", counted)
    outs: list[list] = [[] for _ in range(4)]
    reqs = [
        GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0), outs[i].append)
        for i, p in enumerate(prompts(tokenizer))
    ]
    for r in reqs:
        gen.scheduler.admit(r)
    while any(gen.scheduler.is_running(r) for r in reqs):
        gen.scheduler.step()
    monkeypatch.setattr(PromptProcessingBatch, "prompt", real)
    return passes, [o[-1].token_ids for o in outs]


def test_prompts_prefilling_together_share_a_step_and_keep_their_tokens(tiny, monkeypatch):
    model, tokenizer = tiny
    assert all(len(p) > 3 * STEP for p in prompts(tokenizer))
    alone = [greedy(make_generator(model, tokenizer, BS, prefill_step_size=STEP), p, 6)[0] for p in prompts(tokenizer)]
    shared, shared_tokens = run_together(model, tokenizer, True, monkeypatch)
    each, each_tokens = run_together(model, tokenizer, False, monkeypatch)
    assert shared_tokens == alone and each_tokens == alone
    assert STEP // 4 >= MIN_SHARE and max(shared) <= STEP  # a pass is one chunk, however many prompts
    assert max(each) >= 3 * STEP  # mlx-lm's step: a chunk per prompt
    assert sum(shared) == sum(each)  # the same prompt tokens, in more, shorter passes
