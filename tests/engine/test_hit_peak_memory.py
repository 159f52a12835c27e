"""A cache hit holds one copy of its prefix beside the RAM blocks (issue 44 item 4), by MLX's own count
of the bytes it allocated (mx.get_peak_memory), not by wall time or RSS.

The assembled prefix joins mlx-lm's batch alone without a copy (kv/cache_fill.py `merge_alone`) and is
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
# A restore's files are read a few windows ahead of the run (kv/ssd/run_loads.py: up to 24 blocks'
# payloads beside it): 0.19 copies of a 125-block prefix. Its buffer has room to 8,192 positions.
RESTORE_TOKENS = 8000


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


def test_a_restore_writes_its_prefix_once(tiny, tmp_path):
    """After a restart the chain is read straight into the request's own cache (a direct run,
    kv/runs.py), then registered as views of it: the prefix's bytes are allocated once, where
    reading it into RAM's buffers then assembling the cache from them took two (2.08 copies at
    the peak with the windows read ahead; 1.27 now)."""
    from kvharness import close_ssd

    model, tokenizer = tiny
    prompt = np.random.default_rng(1).integers(3, 250, size=RESTORE_TOKENS).tolist()
    first = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    cold = greedy(first, prompt, 1)
    assert close_ssd(first)
    restarted = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    outcome: list = []
    grown = peak_over_active(lambda: outcome.append(greedy(restarted, prompt, 1)))
    (tokens, _, cached) = outcome[0]
    assert cached == RESTORE_TOKENS - 1
    assert tokens == cold[0]
    copies = grown / kv_bytes(model, cached)
    close_ssd(restarted)
    assert 1.0 <= copies < 1.4, f"the restore's peak is {copies:.2f} copies of its prefix"
