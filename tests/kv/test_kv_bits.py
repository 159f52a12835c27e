"""Quantized KV (`[cache] kv_bits`): hits equal a cold run with the same kv_bits (greedy), from
RAM, from the SSD after a restart and batched; blocks are 2-4x smaller; rounding is idempotent
bit for bit (what makes the hits exact); the bits are part of the namespace."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvharness import close_ssd, greedy, make_generator
from mlx_lm.utils import load
from tinymodel import build_mlx_model

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.kv import blocks, kvquant
from mlx_kvserve.kv.hashing import namespace_hash

BS = 16


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The tiny llama with 32-wide heads (kv_bits quantizes groups of 32)."""
    folder = build_mlx_model(tmp_path_factory.mktemp("kvbits") / "m", hidden_size=128, intermediate_size=256)
    return load(str(folder))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rounding_is_idempotent_and_small(bits, dtype):
    x = (mx.random.normal((1, 2, 40, 64), key=mx.random.key(bits)) * 5).astype(dtype)
    once = kvquant.round_trip(x, bits)
    assert mx.array_equal(kvquant.round_trip(once, bits), once).item()
    q, e = kvquant.quantize(once, bits)
    assert mx.array_equal(kvquant.dequantize(q, e, bits, dtype), once).item()
    assert q.nbytes + e.nbytes <= x.size * (bits / 8) * 1.13  # the integers plus one byte per 32 values
    step = mx.power(2.0, e.astype(mx.float32))  # the error is at most half a step of its group
    err = mx.abs(once.astype(mx.float32) - x.astype(mx.float32)).reshape(1, 2, 40, 2, 32)
    assert (err <= step[..., None] / 2 + 1e-6).all().item()


@pytest.mark.parametrize("bits", [8, 4])
def test_hits_equal_a_cold_run_with_the_same_bits(wide, bits, tmp_path):
    model, tokenizer = wide
    prompt = tokenizer.encode("The lighthouse keeper counted the ships passing in the night fog. " * 4)
    other = prompt[: 5 * BS] + tokenizer.encode(" Something else happened at dawn, said the keeper.")
    cold = {
        p: greedy(make_generator(model, tokenizer, BS, kv_bits=bits), list(v), 12)
        for p, v in (("prompt", prompt), ("other", other))
    }
    assert cold["prompt"][2] == 0

    gen = make_generator(model, tokenizer, BS, ssd_dir=tmp_path, kv_bits=bits)
    greedy(gen, prompt, 12)
    ids, text, cached = greedy(gen, prompt, 12)
    assert (ids, text) == cold["prompt"][:2] and cached == len(prompt) - 1
    ids, _, cached = greedy(gen, other, 12)
    assert ids == cold["other"][0] and cached == 5 * BS
    manager = gen.prefix_cache.manager
    manager.check_integrity()
    # Blocks hold integers and exponents: about 4x (8 bits) / 7x (4 bits) smaller than float32.
    plain = blocks.cache_layout(model, BS)
    full = sum(a.nbytes for c in _cache_after(model, prompt[:BS]) for a in (c.keys, c.values))
    block = next(iter(manager.resident_blocks()))
    assert block.nbytes <= full * (bits / 32) * 1.2, (block.nbytes, full)
    assert plain.signature == "" and gen.prefix_cache.layout.signature == f"kv_bits={bits}"
    assert close_ssd(gen)

    restarted = make_generator(model, tokenizer, BS, ssd_dir=tmp_path, kv_bits=bits)
    ids, text, cached = greedy(restarted, prompt, 12)
    assert (ids, text) == cold["prompt"][:2] and cached == len(prompt) - 1
    assert restarted.prefix_cache.ssd_tier.store.stats()["ssd_hits"] >= 1
    close_ssd(restarted)


def test_batched_hits_equal_cold_with_kv_bits(wide):
    model, tokenizer = wide
    base = tokenizer.encode("Rivers and mountains and valleys and seas, all in a row. " * 5)
    prompts = {"a": base[: 4 * BS + 3], "b": base[: 2 * BS] + tokenizer.encode(" A new branch."), "c": base}
    cold = {k: greedy(make_generator(model, tokenizer, BS, kv_bits=8), p, 10)[0] for k, p in prompts.items()}
    gen = make_generator(model, tokenizer, BS, kv_bits=8)
    greedy(gen, base, 10)
    events = {k: [] for k in prompts}
    reqs = [GenerationRequest(k, p, SamplingParams(max_tokens=10), events[k].append) for k, p in prompts.items()]
    for req in reqs:
        gen.scheduler.admit(req)
    while any(gen.scheduler.is_running(r) for r in reqs):
        gen.scheduler.step()
    for k in prompts:
        done = events[k][-1]
        assert isinstance(done, Finished) and done.token_ids == cold[k], k
        assert done.usage.cached_tokens > 0


def test_kv_bits_name_their_own_namespace_and_need_wide_heads(wide, tiny_model_dir):
    model, _ = wide
    sigs = {bits: blocks.cache_layout(model, BS, bits).signature for bits in (0, 4, 8)}
    names = {namespace_hash("m", "float32", BS, cache_layout=sig) for sig in sigs.values()}
    assert len(names) == 3
    narrow, _ = load(str(tiny_model_dir))  # 16-wide heads
    layout = blocks.cache_layout(narrow, BS, 8)
    assert not layout.supported and "divisible by 32" in layout.reason


def _cache_after(model, tokens):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache
