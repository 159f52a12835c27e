"""The tiny family models (tests/familymodels.py) load with mlx-lm, have the cache layout the
cache code must handle, and decode greedily to varied tokens (a flat model would hide bugs)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from familymodels import EXPECTED_CACHES, FAMILIES, build_family_model, cache_kinds
from harness.synthetic import family_config, random_model, write_model_folder
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load


def _greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens = []
    for _ in range(num_tokens):
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_family_model_loads_with_its_cache_layout_and_varied_greedy_tokens(tmp_path, family):
    folder = build_family_model(tmp_path / family, family)
    model, tokenizer = load(str(folder))

    kinds = cache_kinds(make_prompt_cache(model))
    print(family, kinds)
    assert kinds == EXPECTED_CACHES[family]

    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again.")
    tokens = _greedy(model, prompt, 20)
    assert len(set(tokens)) > 1, tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_family_model_gives_the_same_logits_after_load(tmp_path, family):
    """sanitize() runs on load: what write_model_folder saves must come back unchanged."""
    config = family_config(family)
    built = random_model(config, seed=1)
    loaded, _ = load(str(write_model_folder(tmp_path / family, config, built)))
    prompt = mx.array([list(range(10, 70))])
    assert mx.array_equal(built(prompt), loaded(prompt)).item()


def test_family_config_overrides_and_vocab():
    config = family_config("gemma3_text", sliding_window=8)
    assert config["sliding_window"] == 8
    assert config["vocab_size"] > 256
    with pytest.raises(KeyError):
        family_config("no_such_family")
