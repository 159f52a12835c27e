"""Build a tiny random-weight vision-language model folder from mlx-vlm's own classes.

    python scripts/make_tiny_vlm.py --family gemma3 OUT_DIR

The folder holds config.json, model.safetensors (mlx-vlm's parameter names: vision_tower.*,
multi_modal_projector.*, language_model.*), preprocessor_config.json and the byte-level tokenizer of
scripts/harness/synthetic.py with the family's image tokens added; `mlx-kvserve run --model OUT_DIR`
serves it. Only gemma3 is built so far (qwen2_vl's M-RoPE positions are not served yet: docs/vision.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlx_kvserve.models.gguf_tokenizer import write_tokenizer_files

from .synthetic import base_vocab_size, tokenizer_meta

GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
FAMILIES = ("gemma3",)


def gemma3_config(
    vocab_size: int, ids: dict[str, int], mm_tokens: int = 16, window: int = 0, image_size: int = 56
) -> dict[str, Any]:
    """config.json of a tiny Gemma 3: 2 text layers (hidden 64), a 1-layer SigLIP tower over 56x56
    images in 7x7 patches, pooled to `mm_tokens` image tokens. `window` > 0: the first layer is a
    sliding-window layer of that many positions (as Gemma 3's 5 of every 6), else both are global."""
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "sliding_window": window or 4096,
        "sliding_window_pattern": 2 if window else 1,
        "mm_tokens_per_image": mm_tokens,
        "max_position_embeddings": 4096,
        "rope_scaling": None,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 7,
        "image_size": image_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": mm_tokens,
        "pad_token_id": 0,
        "eos_token_id": [2],
        "text_config": text,
        "vision_config": vision,
    }


def random_vlm(config: dict[str, Any], seed: int = 0, scale: float = 4.0) -> Any:
    """mlx-vlm's Gemma 3 Model with random weights (matrices times `scale`, so greedy decoding is not
    flat), float32, evaluated."""
    from mlx_kvserve.vision.families import vlm_model_config

    mx.random.seed(seed)
    module, model_config = vlm_model_config(config)
    model = module.Model(model_config)
    model.update(tree_map(lambda a: (a * scale if a.ndim >= 2 else a).astype(mx.float32), model.parameters()))
    projector = model.multi_modal_projector  # initialized to ones: every image token would look alike
    projector.mm_input_projection_weight = mx.random.normal(projector.mm_input_projection_weight.shape)
    mx.eval(model.parameters())
    return model


def build(
    folder: Path, family: str = "gemma3", seed: int = 0, window: int = 0, mm_tokens: int = 16, image_size: int = 56
) -> Path:
    """Write the tiny model of `family` to `folder` (created); returns it. `image_size` (a multiple
    of 7) and `mm_tokens` (a square whose side divides image_size / 7) size the images."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: only {', '.join(FAMILIES)} is built")
    folder.mkdir(parents=True, exist_ok=True)
    meta = tokenizer_meta(base_vocab_size() + len(GEMMA3_TOKENS) + 13)  # room for the image tokens
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ids = {}
    for name in GEMMA3_TOKENS:  # replace filler tokens: specials the tokenizer never splits
        at = tokens.index(next(t for t in tokens if t.startswith("<|fill_")))
        tokens[at], types[at], ids[name] = name, 3, at
    config = gemma3_config(len(tokens), ids, mm_tokens, window, image_size)
    write_tokenizer_files(meta, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": image_size, "width": image_size}}
        )
    )
    model = random_vlm(config, seed)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder
