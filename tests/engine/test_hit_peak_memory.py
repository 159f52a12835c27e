"""A cache hit holds one copy of its prefix beside the RAM blocks (issue 44 item 4), by MLX's own count
of the bytes it allocated (mx.get_peak_memory), not by wall time or RSS.

The assembled prefix joins mlx-lm's batch alone without a copy (kv/blocks.py `_merge_alone`) and is
written in place; a request ending in the decode pass leaves with views of its batch row
(engine/batch/mlx_batch.py `_ended_row`), not mlx-lm's `extract` (a contiguous copy of its row's filled
positions, its blocks and tails then cut from that): 1.31 copies at the peak on the direct join and
2.08 on the batch's own prompt step with the copy, 1.10 both with views. Unless its buffer is exactly
full (then the copy is a view): the prompt length below avoids that."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from kvharness import greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.batch import direct_join

BS = 64
# 26 blocks and 35 of the tail's tokens are cached (the last prompt token is prefilled): the
# assembled buffer has room up to 1,792 positions (mlx-lm's 256-token step), 5% beside the prefix,
# of which 1,701 are filled when the request ends (not full: see above).
PROMPT_TOKENS = 1700


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def kv_bytes(model, tokens: int) -> int:
    """The full-attention KV of `tokens` positions (float32 keys and values, every layer)."""
    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    return 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * 4 * tokens


def peak_over_active(run) -> int:
    """The most bytes MLX held at once while `run()` ran, over what it held before."""
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    run()
    return mx.get_peak_memory() - before


@pytest.mark.parametrize("path", ["direct", "batch"])
def test_an_exact_repeat_holds_one_copy_of_its_prefix(tiny, monkeypatch, path):
    model, tokenizer = tiny
    if path == "batch":  # the rest prefilled by the batch's prompt step, not joined directly
        monkeypatch.setattr(direct_join, "fits", lambda *a: False)
    prompt = np.random.default_rng(0).integers(3, 250, size=PROMPT_TOKENS).tolist()
    gen = make_generator(model, tokenizer, BS)
    cold = greedy(gen, prompt, 1)
    outcome: list = []
    grown = peak_over_active(lambda: outcome.append(greedy(gen, prompt, 1)))
    (tokens, _, cached) = outcome[0]
    assert cached == PROMPT_TOKENS - 1
    assert tokens == cold[0]
    copies = grown / kv_bytes(model, cached)
    assert 1.0 <= copies < 1.2, f"the hit's peak is {copies:.2f} copies of its prefix"
