"""Build a tiny random-weight vision-language model folder from mlx-vlm's own classes.

    python scripts/features.py tiny-vlm --family gemma3 OUT_DIR   (--family qwen2_vl --image-size 112)

The folder holds config.json, model.safetensors (mlx-vlm's parameter names: vision_tower.*,
multi_modal_projector.*, language_model.*), preprocessor_config.json and the byte-level tokenizer of
scripts/harness/synthetic.py with the family's image tokens added; `mlx-kvserve run --model OUT_DIR`
serves it. Families: gemma3 (SigLIP, fixed soft tokens per image) and qwen2_vl (merged patches,
M-RoPE positions). The qwen2_vl folder also holds a preprocessor_config.json and chat template that
mlx-vlm's own loader and processor read offline (the peer benchmark serves it with mlx_vlm.server).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlx_kvserve.models.gguf_tokenizer import write_tokenizer_files

from .synthetic import base_vocab_size, tokenizer_meta

GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
FAMILIES = ("gemma3", "qwen2_vl")
# Qwen2-VL's template, cut down: string content, or parts (mlx-vlm's server sends {"type": "image"}).
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'input_image') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


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


def qwen2_vl_config(vocab_size: int, ids: dict[str, int], max_pixels: int = 112 * 112) -> dict[str, Any]:
    """config.json of a tiny Qwen2-VL (flat, as Hugging Face writes it): 2 text layers (hidden 64,
    head_dim 16, mrope_section [2, 3, 3]), a 1-layer tower over 14x14 patches merged 2x2: an
    image of at most `max_pixels` (112x112 by default) becomes at most 16 soft tokens."""
    return {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }


def random_vlm(config: dict[str, Any], seed: int = 0, scale: float = 4.0) -> Any:
    """mlx-vlm's Model of `config`'s family with random weights (matrices times `scale`, so greedy
    decoding is not flat), float32, evaluated."""
    from mlx_kvserve.vision.families import vlm_model_config

    mx.random.seed(seed)
    module, model_config = vlm_model_config(config)
    model = module.Model(model_config)
    model.update(tree_map(lambda a: (a * scale if a.ndim >= 2 else a).astype(mx.float32), model.parameters()))
    projector = getattr(model, "multi_modal_projector", None)  # Gemma 3's: ones, every image token alike
    if projector is not None:
        projector.mm_input_projection_weight = mx.random.normal(projector.mm_input_projection_weight.shape)
    mx.eval(model.parameters())
    return model


def build(
    folder: Path, family: str = "gemma3", seed: int = 0, window: int = 0, mm_tokens: int = 16, image_size: int = 56
) -> Path:
    """Write the tiny model of `family` to `folder` (created); returns it. gemma3: `image_size` (a
    multiple of 7) and `mm_tokens` (a square whose side divides image_size / 7) size the images;
    qwen2_vl: images are resized within image_size^2 pixels (sides multiples of 28), one soft token
    per 28x28."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: only {', '.join(FAMILIES)} are built")
    folder.mkdir(parents=True, exist_ok=True)
    specials = GEMMA3_TOKENS if family == "gemma3" else QWEN_TOKENS
    meta = tokenizer_meta(base_vocab_size() + len(specials) + 13)  # room for the image tokens
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ids = {}
    for name in specials:  # replace filler tokens: specials the tokenizer never splits
        at = tokens.index(next(t for t in tokens if t.startswith("<|fill_")))
        tokens[at], types[at], ids[name] = name, 3, at
    if family == "gemma3":
        config = gemma3_config(len(tokens), ids, mm_tokens, window, image_size)
        pre = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": image_size, "width": image_size}}
    else:
        meta["tokenizer.chat_template"] = QWEN_TEMPLATE
        config = qwen2_vl_config(len(tokens), ids, image_size * image_size)
        pre = qwen2_vl_preprocessor(image_size * image_size)
    write_tokenizer_files(meta, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    model = random_vlm(config, seed)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if "rotary_emb" not in k}  # not weights
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def qwen2_vl_preprocessor(max_pixels: int) -> dict[str, Any]:
    """Qwen2-VL's image processor settings (Hugging Face's names, old and new), for images of at
    most `max_pixels`."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "min_pixels": 28 * 28,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": 28 * 28, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=FAMILIES, default="gemma3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=0, help="sliding window of the first layer (0: none)")
    parser.add_argument("--mm-tokens", type=int, default=16, help="soft tokens per image (a square)")
    parser.add_argument(
        "--image-size",
        type=int,
        default=56,
        help="gemma3: the tower's image side (a multiple of 7); qwen2_vl: images fit in its square's pixels",
    )
    parser.add_argument("out_dir", type=Path)


def run(args: argparse.Namespace) -> None:
    print(build(args.out_dir, args.family, args.seed, args.window, args.mm_tokens, args.image_size))
