"""Qwen2-VL / Qwen2.5-VL: images as a grid of merged patches, and M-RoPE positions.

Positions. Qwen2-VL's language model rotates each token by three positions (time, height, width;
M-RoPE): a text token's three are equal, an image's tokens take the grid's coordinates offset by
where the image starts, and the text after an image resumes at the image's start + max(t, h, w),
not at its index: every later token sits at index + rope_delta, rope_delta summing
max(t, h, w) - t*h*w over the images before it (mlx-vlm's LanguageModel.get_rope_index).

What that means for the block cache. Keys are stored rotated, so the KV of a prefix depends on
nothing but the prefix's tokens and images, whose content keys the chain already holds: cached
blocks stay valid wherever they are reused. What a hit must restore is where the *next* token
sits: rope_delta of the images before it. It is recomputed from the prompt's image spans on every
start (cold, RAM or SSD hit, after a restart, batched) rather than stored with the blocks: an
image's grid is a function of its preprocessed pixels' shape, which its digest covers, so the
same cache keys always give the same rope_delta, and nothing is added to the block or SSD format.

How it runs on mlx-lm's Qwen2 (which rotates by the cache offset alone): the prefill from input
embeddings rotates by explicit 3-D positions (MRoPE below replaces each attention's rope and uses
them while `positioned` holds them), and the batch decodes at cache length + rope_delta
(kv/blocks.py: shift_positions, applied by the scheduler with `rope_delta`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import InvalidRequestError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # Qwen2-VL's processor refuses images longer than this times their width (or taller)


class _Positions:
    """The 3-D positions (3, L) of the chunk being prefilled, shared by every layer's MRoPE
    (a plain object: an mx.array attribute of a Module would count as a parameter)."""

    ids: mx.array | None = None


class MRoPE(nn.Module):
    """mlx-lm's rope (nn.RoPE, non-traditional) with M-RoPE when 3-D positions are set: frequency
    j is rotated by the position of the section it falls in (mrope_section: time, height, width).
    With equal positions it is the plain rope, which it runs when none are set."""

    def __init__(self, rope: nn.Module, sections: Sequence[int], base: float, state: _Positions):
        super().__init__()
        self.rope = rope
        self.shared = state
        half = sum(sections)
        self.axis = np.repeat(np.arange(3), sections)  # frequency -> position axis
        self._freq = (base ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))).astype(np.float32)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        ids = self.shared.ids
        if ids is None:
            return self.rope(x, offset=offset)
        angles = ids[mx.array(self.axis)].T.astype(mx.float32) * mx.array(self._freq)  # (L, half)
        cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
        half = angles.shape[-1]
        x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image processor: sides rounded to multiples of `factor`, the area kept within
    [min_pixels, max_pixels] with the aspect ratio. InvalidRequestError (400) past MAX_ASPECT_RATIO,
    which the processor cannot resize within those bounds."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise InvalidRequestError(
            f"the image is {width}x{height} pixels: its aspect ratio is over the limit of "
            f"{MAX_ASPECT_RATIO}:1 (Qwen2-VL's image processor)"
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class Qwen2VLFamily:
    """Qwen2-VL and Qwen2.5-VL (mlx-vlm's vision towers; mlx-lm runs both language models as
    Qwen2). Each image is "<|vision_start|>" + one "<|image_pad|>" per merged patch +
    "<|vision_end|>", as its processor writes it; the soft tokens' embeddings are the tower's
    merged features."""

    name = "qwen2_vl"
    marker = "<|vision_start|>"  # what a chat template renders for an image part

    def __init__(self, config: dict[str, Any], tokenizer: Any, vlm: Any, preprocessor: dict[str, Any]):
        text = {**config, **(config.get("text_config") or {})}
        vision = config["vision_config"]
        self.vlm = vlm  # mlx-vlm's Model: its vision_tower is used
        self.dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
        self.image_token = int(config.get("image_token_id") or tokenizer.convert_tokens_to_ids("<|image_pad|>"))
        self.marker_token = int(config.get("vision_start_token_id") or tokenizer.convert_tokens_to_ids(self.marker))
        self.end_token = int(config.get("vision_end_token_id") or tokenizer.convert_tokens_to_ids("<|vision_end|>"))
        self.patch = int(vision.get("patch_size", 14))
        self.merge = int(vision.get("spatial_merge_size", 2))
        self.temporal = int(vision.get("temporal_patch_size", 2))
        size = preprocessor.get("size") or {}
        self.min_pixels = int(preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(preprocessor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.mean = np.asarray(preprocessor.get("image_mean", CLIP_MEAN), dtype=np.float32)[:, None, None]
        self.std = np.asarray(preprocessor.get("image_std", CLIP_STD), dtype=np.float32)[:, None, None]
        self.sections = list((text.get("rope_scaling") or {}).get("mrope_section") or [16, 24, 24])
        self.rope_theta = float(text.get("rope_theta", 1000000.0))
        self._positions = _Positions()

    # --- HTTP threads ----------------------------------------------------------------------------

    def preprocess(self, image: Any) -> np.ndarray:
        """A PIL RGB image as the tower takes it: resized (bicubic) to sides that are multiples of
        patch * merge within the pixel bounds, scaled to [0, 1], normalized; (3, H, W) float32."""
        from PIL import Image

        factor = self.patch * self.merge
        h, w = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        resized = image.resize((w, h), Image.Resampling.BICUBIC)
        pixels = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return np.ascontiguousarray((pixels - self.mean) / self.std, dtype=np.float32)

    def grid(self, pixels: np.ndarray) -> tuple[int, int, int]:
        """(t, h, w) in patches (one frame: t = 1)."""
        return 1, pixels.shape[1] // self.patch, pixels.shape[2] // self.patch

    def placeholder(self, pixels: np.ndarray) -> tuple[list[int], int, int]:
        """The tokens one image marker becomes, the offset of its first soft token, their count."""
        _, h, w = self.grid(pixels)
        n = (h // self.merge) * (w // self.merge)
        return [self.marker_token, *[self.image_token] * n, self.end_token], 1, n

    # --- the MLX worker --------------------------------------------------------------------------

    def encode(self, pixels: np.ndarray) -> mx.array:
        """The merged features of one image: (soft tokens, hidden)."""
        t, h, w = self.grid(pixels)
        m, p = self.merge, self.patch
        frames = np.repeat(pixels[None], self.temporal, axis=0)  # an image is `temporal` equal frames
        x = frames.reshape(1, self.temporal, 3, h // m, m, p, w // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(h * w, 3 * self.temporal * p * p)
        return self.vlm.vision_tower(mx.array(x).astype(self.dtype), mx.array([[t, h, w]]))

    def embed(self, language_model: Any, tokens: list[int], pieces: list[tuple[int, mx.array]]) -> mx.array:
        """Input embeddings (1, len(tokens), hidden) with each (offset, features) put over the soft
        tokens from that offset on."""
        h = language_model.language_model.model.embed_tokens(mx.array(tokens)[None])
        for offset, features in pieces:
            h[0, offset : offset + features.shape[0]] = features.astype(h.dtype)
        return h

    def rope_delta(self, images: Sequence[Any]) -> int:
        """Where the token after `images` sits relative to its index (see the module's docstring)."""
        delta = 0
        for span in images:
            t, h, w = self.grid(span.pixels)
            delta += max(t, h // self.merge, w // self.merge) - span.length
        return delta

    def positions(self, images: Sequence[Any], start: int, end: int) -> mx.array:
        """The (3, end - start) M-RoPE positions of prompt tokens start..end-1."""
        ids = np.arange(start, end)[None].repeat(3, axis=0)
        delta = 0
        for span in images:
            _, h, w = self.grid(span.pixels)
            gh, gw = h // self.merge, w // self.merge
            base = span.start + delta
            lo, hi = max(span.start, start), min(span.end, end)
            if lo < hi:
                k = np.arange(lo - span.start, hi - span.start)
                ids[:, lo - start : hi - start] = base + np.stack([np.zeros_like(k), k // gw, k % gw])
            delta += max(1, gh, gw) - span.length
            after = max(span.end, start)
            if after < end:
                ids[:, after - start :] = np.arange(after, end) + delta
        return mx.array(ids)

    @contextmanager
    def positioned(self, language_model: Any, images: Sequence[Any], start: int, end: int) -> Iterator[None]:
        """While held, the model's attention rotates tokens start..end-1 by their M-RoPE positions."""
        self._install(language_model)
        self._positions.ids = self.positions(images, start, end)
        try:
            yield
        finally:
            self._positions.ids = None

    def _install(self, language_model: Any) -> None:
        """Put MRoPE in place of each attention layer's rope (once; it runs the plain rope unless
        positions are set, so the batch's decoding is unchanged)."""
        for layer in language_model.layers:
            attn = layer.self_attn
            if not isinstance(attn.rope, MRoPE):
                attn.rope = MRoPE(attn.rope, self.sections, self.rope_theta, self._positions)
