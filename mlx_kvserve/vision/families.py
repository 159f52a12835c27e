"""What each vision-language family needs: image preprocessing, the placeholder tokens one image
becomes in the prompt, the vision tower (mlx-vlm's classes) and how its output enters the
language model's input embeddings.

Served: Gemma 3 (plain 1-D RoPE positions) and Qwen2-VL / Qwen2.5-VL (M-RoPE: vision/qwen.py).
A family's interface: `marker` / `marker_token` (what a chat template renders for an image),
`image_token`, `preprocess`, `placeholder`, `encode`, `embed`, `positioned` (the positions a
prefill from embeddings runs at) and `rope_delta` (None: tokens sit at their index).
"""

from __future__ import annotations

import json
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from blake3 import blake3

VISUAL = re.compile(r"^(model\.)?visual\.")

SUPPORTED = ("gemma3", "qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its placeholder tokens are prompt[start:start + length]; `digest`
    covers its preprocessed pixels (dtype, shape and values), `pixels` are those pixels."""

    start: int
    length: int
    digest: bytes
    pixels: np.ndarray

    @property
    def end(self) -> int:
        return self.start + self.length


def pixel_digest(pixels: np.ndarray) -> bytes:
    """The content hash of preprocessed pixels: the same image decoded from PNG or from a
    lossless re-encode hashes the same; any pixel, size or preprocessing change does not."""
    header = f"{pixels.dtype.str}|{pixels.shape}".encode()
    return blake3(header + np.ascontiguousarray(pixels).tobytes()).digest()


class Gemma3Family:
    """Gemma 3: a SigLIP tower at a fixed square size, pooled to `mm_tokens_per_image` soft
    tokens; each image is "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n" in the
    prompt (as its processor writes it), and the soft tokens' embeddings are the projected
    features (divided by sqrt(hidden), since the language model scales every embedding by it)."""

    name = "gemma3"
    marker = "<start_of_image>"  # what a chat template renders for an image part

    def __init__(self, config: dict[str, Any], tokenizer: Any, vlm: Any, preprocessor: dict[str, Any]):
        text, vision = config["text_config"], config["vision_config"]
        self.vlm = vlm  # mlx-vlm's Model: vision_tower and multi_modal_projector are used
        self.image_token = int(config["image_token_index"])
        self.marker_token = int(config.get("boi_token_index") or tokenizer.convert_tokens_to_ids(self.marker))
        self.end_token = int(config.get("eoi_token_index") or tokenizer.convert_tokens_to_ids("<end_of_image>"))
        self.num_tokens = int(config.get("mm_tokens_per_image") or text.get("mm_tokens_per_image", 256))
        self.size = int(vision.get("image_size", 896))
        self.hidden = int(text["hidden_size"])
        self.mean = np.asarray(preprocessor.get("image_mean", [0.5] * 3), dtype=np.float32)[:, None, None]
        self.std = np.asarray(preprocessor.get("image_std", [0.5] * 3), dtype=np.float32)[:, None, None]
        self.newlines = list(tokenizer.encode("\n\n", add_special_tokens=False))

    def preprocess(self, image: Any) -> np.ndarray:
        """A PIL RGB image as the tower takes it: resized to size x size (bilinear), scaled to
        [0, 1], normalized; (3, size, size) float32."""
        from PIL import Image

        resized = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        pixels = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return np.ascontiguousarray((pixels - self.mean) / self.std, dtype=np.float32)

    def placeholder(self, pixels: np.ndarray) -> tuple[list[int], int, int]:
        """The tokens one image marker becomes, the offset of its first soft token, their count."""
        before = [*self.newlines, self.marker_token]
        soft = [self.image_token] * self.num_tokens
        return [*before, *soft, self.end_token, *self.newlines], len(before), self.num_tokens

    def rope_delta(self, images: Any) -> None:
        return None  # plain positions: every token sits at its index

    def positioned(self, language_model: Any, images: Any, start: int, end: int) -> Any:
        return nullcontext()

    def encode(self, pixels: np.ndarray) -> mx.array:
        """The projected features of one image: (num_tokens, hidden)."""
        x = mx.array(pixels[None].transpose(0, 2, 3, 1))
        dtype = self.vlm.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        hidden, _, _ = self.vlm.vision_tower(x.astype(dtype), output_hidden_states=True)
        return self.vlm.multi_modal_projector(hidden)[0]

    def embed(self, language_model: Any, tokens: list[int], pieces: list[tuple[int, mx.array]]) -> mx.array:
        """Input embeddings (1, len(tokens), hidden) of `tokens`, with each (offset, features) of
        `pieces` put over the soft tokens from that offset on."""
        embed_tokens = language_model.language_model.model.embed_tokens
        h = embed_tokens(mx.array(tokens)[None])
        scale = self.hidden**0.5
        for offset, features in pieces:
            h[0, offset : offset + features.shape[0]] = (features / scale).astype(h.dtype)
        return h


def load_family(path: Path, config: dict[str, Any], tokenizer: Any) -> Any:
    """The family of the model folder at `path` with its vision tower loaded (mlx-vlm's classes,
    only the vision weights read). ValueError for a family not served."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"vision family {model_type!r} is not served (served: {', '.join(SUPPORTED)})")
    vlm = load_vision_tower(path, config)
    pre = path / "preprocessor_config.json"
    preprocessor = json.loads(pre.read_text()) if pre.exists() else {}
    if model_type == "gemma3":
        return Gemma3Family(config, tokenizer, vlm, preprocessor)
    from .qwen import Qwen2VLFamily

    return Qwen2VLFamily(config, tokenizer, vlm, preprocessor)


def vlm_model_config(config: dict[str, Any]) -> Any:
    """mlx-vlm's ModelConfig for `config`, with its text and vision sub-configs as their classes."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(config)
    params = json.loads(json.dumps(config))  # Qwen2-VL's from_dict adds text_config (its config is flat)
    model_config = module.ModelConfig.from_dict(params)
    return module, update_module_configs(model_config, module, params, ["text", "vision"])


def load_vision_tower(path: Path, config: dict[str, Any]) -> Any:
    """mlx-vlm's Model for `config` with the vision tower's and projector's weights loaded from
    the folder's safetensors (the language model's weights are left to mlx-lm and never read)."""
    module, model_config = vlm_model_config(config)
    vlm = module.Model(model_config)
    vlm.language_model = None  # mlx-lm runs the language model
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        for key, value in mx.load(str(file)).items():
            key = VISUAL.sub("vision_tower.", key)  # Hugging Face's Qwen2-VL names
            if key.startswith(("vision_tower.", "multi_modal_projector.")):
                weights[key] = value
    tower = {k.removeprefix("vision_tower."): v for k, v in weights.items() if k.startswith("vision_tower.")}
    weights.update({f"vision_tower.{k}": v for k, v in vlm.vision_tower.sanitize(tower).items()})
    vlm.load_weights(list(weights.items()), strict=False)
    mx.eval(vlm.parameters())
    return vlm
