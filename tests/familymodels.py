"""Tiny random-weight models of the mlx-lm families whose caches are not one KVCache per layer.

Each is written as an MLX folder with the byte tokenizer (see tinymodel.py), so tests of sliding
windows (RotatingKVCache) and recurrent layers (ArraysCache) need no download. The shapes live in
harness.synthetic.FAMILY_CONFIGS (scripts/harness/synthetic.py).
"""

from __future__ import annotations

from pathlib import Path

from harness.synthetic import FAMILY_CONFIGS, family_config, random_model, write_model_folder

FAMILIES: tuple[str, ...] = tuple(FAMILY_CONFIGS)

# What make_prompt_cache gives each family: one entry per cache (nemotron_h's MLP blocks have none).
# ("KVCache",), ("RotatingKVCache", max_size, keep), ("ArraysCache", number of arrays).
EXPECTED_CACHES: dict[str, list[tuple]] = {
    "qwen3_5": [("ArraysCache", 2), ("KVCache",)] * 2,
    "qwen3_next": [("ArraysCache", 2), ("KVCache",)] * 2,
    "gemma3_text": [("RotatingKVCache", 24, 0), ("RotatingKVCache", 24, 0), ("KVCache",)] * 2,
    "gpt_oss": [("RotatingKVCache", 24, 0), ("KVCache",)] * 2,
    "nemotron_h": [("ArraysCache", 2), ("KVCache",), ("ArraysCache", 2)],
    "lfm2": [("ArraysCache", 1), ("ArraysCache", 1), ("KVCache",)] * 2,
    "mamba2": [("ArraysCache", 2)] * 3,
}


def cache_kinds(caches: list) -> list[tuple]:
    """Describe a prompt cache in the shape of EXPECTED_CACHES."""
    kinds = []
    for c in caches:
        name = type(c).__name__
        if name == "RotatingKVCache":
            kinds.append((name, c.max_size, c.keep))
        elif name == "ArraysCache":
            kinds.append((name, len(c.cache)))
        else:
            kinds.append((name,))
    return kinds


def build_family_model(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny random-weight model of `family` (one of FAMILIES) in MLX format, float32."""
    config = family_config(family, **overrides)
    return write_model_folder(folder, config, random_model(config, seed=seed))
