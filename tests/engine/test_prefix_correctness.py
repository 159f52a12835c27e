"""A cache hit must give exactly the output of a cold run (greedy) and allclose final logits.
Never weaken these tests: they are the product's correctness guarantee."""

import mlx.core as mx
import pytest
from kvharness import cold_logits, final_logits, greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.kv.tails import common_prefix

ATOL = 1e-3
RTOL = 1e-3


def _check_case(model, tokenizer, block_size, warm_prompts, prompt, max_tokens, expect_cached, tails):
    cold_gen = make_generator(model, tokenizer, block_size, tails=tails)
    cold_ids, cold_text, cached = greedy(cold_gen, prompt, max_tokens)
    assert cached == 0
    reference = cold_logits(model, prompt)

    warm_gen = make_generator(model, tokenizer, block_size, tails=tails)
    warm_ids = [greedy(warm_gen, warm, max_tokens)[0] for warm in warm_prompts]
    if callable(expect_cached):  # depends on what the warm-up generated
        expect_cached = expect_cached(warm_ids)
    logits, cached_for_logits = final_logits(warm_gen, prompt)
    hit_ids, hit_text, cached = greedy(warm_gen, prompt, max_tokens)
    assert cached == expect_cached == cached_for_logits
    assert hit_ids == cold_ids
    assert hit_text == cold_text
    assert mx.allclose(logits, reference, atol=ATOL, rtol=RTOL).item(), mx.abs(logits - reference).max().item()
    warm_gen.prefix_cache.manager.check_integrity()
    return cold_ids


def _cases(tokenizer, block_size):
    """(name, warm-up prompts, prompt, cached tokens expected without tails, with tails)."""
    text = " ".join(f"Fact {i}: the river number {i} flows into the sea near town {i * 7}." for i in range(40))
    base = tokenizer.encode(text)
    bs = block_size
    mid = base[: 6 * bs + bs // 2]  # ends mid-block
    exact = base[: 6 * bs]  # ends on a block boundary: the last block must still be prefilled
    other = base[: 3 * bs] + tokenizer.encode(" A completely different ending follows here, with more words.")
    return [
        ("full chain", [mid], mid, 6 * bs, len(mid) - 1),
        ("partial chain", [mid], other, 3 * bs, 3 * bs),
        # With tails, the warm-up's generated tokens are reusable where they match the prompt.
        ("mid-block", [base[: 4 * bs]], mid, 4 * bs, lambda ids: common_prefix(base[: 4 * bs] + list(ids[0]), mid)),
        ("block boundary", [exact], exact, 5 * bs, len(exact) - 1),
    ]


def _run_all(model, tokenizer, block_size, max_tokens, modes=(False, True)):
    for tails in modes:
        for name, warm, prompt, expect_blocks, expect_tails in _cases(tokenizer, block_size):
            expect = expect_tails if tails else expect_blocks
            try:
                _check_case(model, tokenizer, block_size, warm, prompt, max_tokens, expect, tails)
            except AssertionError as exc:
                raise AssertionError(f"case {name!r} (tails={tails}): {exc}") from exc


def _conversation(model, tokenizer, block_size, max_tokens, modes=(False, True)):
    """Turn 2 extends turn 1's prompt and its generated tokens: the hit includes decode-time KV."""
    for tails in modes:
        gen = make_generator(model, tokenizer, block_size, tails=tails)
        turn1 = tokenizer.encode(" ".join(f"Line {i} of the story about a lighthouse keeper." for i in range(12)))
        ids1, _, _ = greedy(gen, turn1, max_tokens)
        turn2 = turn1 + list(ids1) + tokenizer.encode(" And then the keeper said:")
        seq = len(turn1) + len(ids1)
        expect = seq if tails else (seq // block_size) * block_size
        cold_gen = make_generator(model, tokenizer, block_size, tails=tails)
        cold_ids, _, _ = greedy(cold_gen, turn2, max_tokens)
        logits, cached = final_logits(gen, turn2)
        hit_ids, _, cached2 = greedy(gen, turn2, max_tokens)
        assert cached == cached2 == expect > len(turn1) // block_size * block_size
        assert hit_ids == cold_ids
        reference = cold_logits(model, turn2)
        assert mx.allclose(logits, reference, atol=ATOL, rtol=RTOL).item(), mx.abs(logits - reference).max().item()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def test_tiny_hits_match_cold(tiny):
    _run_all(*tiny, block_size=16, max_tokens=24)


def test_tiny_conversation_turn2_reuses_generated_tokens(tiny):
    _conversation(*tiny, block_size=16, max_tokens=40)


@pytest.mark.slow
def test_smollm_hits_match_cold(smollm_dir):
    model, tokenizer = load(str(smollm_dir))
    # The real model runs the production configuration (tails on); the tiny one covers both.
    _run_all(model, tokenizer, block_size=32, max_tokens=12, modes=(True,))
    _conversation(model, tokenizer, block_size=32, max_tokens=40, modes=(True,))


def test_assembled_cache_has_room_to_prefill_in_place(tiny):
    """assemble(room=n): the prefix's KV plus spare capacity, so prefilling n tokens writes into
    the buffers instead of copying the whole prefix to grow them; the logits do not change."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvserve.kv import blocks

    model, tokenizer = tiny
    prompt = tokenizer.encode("The harbour light shines over the quiet water tonight. " * 12)[:200]
    full = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt[:160])[None], cache=full))
    layout = blocks.cache_layout(model, 16)
    payloads = [p for p, _ in layout.slice_blocks(full, 0, 10, 16)]  # 160 tokens in 16-token blocks
    rest = mx.array(prompt[160:])[None]
    tight = layout.assemble(payloads)
    roomy = layout.assemble(payloads, room=rest.shape[1])
    assert tight[0].keys.shape[2] == 160 and tight[0].offset == roomy[0].offset == 160
    assert roomy[0].keys.shape[2] == 256  # 160 + 40 rounded up to mlx-lm's 256-token step
    expected = model(rest, cache=tight)[0, -1]
    got = model(rest, cache=roomy)[0, -1]
    assert roomy[0].keys.shape[2] == 256 and roomy[0].offset == 200  # filled in place, not regrown
    assert mx.allclose(got, expected, atol=ATOL, rtol=RTOL).item()
