"""The engine's one door to vision: prompts with images built on HTTP threads, image features and
the prefill from embeddings on the MLX worker.

How images enter the block cache: an image's placeholder tokens are the same ids for every image,
so the ids the cache keys a prompt by (`GenerationRequest.cache_tokens`) put, in place of each
placeholder, ids derived from the image's pixel digest (chain.content_keys). The block chain, the
token comparison on every hit, tails and the SSD files all see those keys: the same image and text
hit, a different image misses from the block holding its first soft token on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..chain import content_keys
from ..errors import InvalidRequestError
from .encoder_cache import EncoderCache
from .families import ImageSpan, pixel_digest
from .images import ImageLimits, ImageRef, check_count, decode_image


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt with its images: the ids the model reads, the ids the cache keys it by, the spans."""

    tokens: list[int]
    cache_tokens: list[int]
    images: tuple[ImageSpan, ...]


class VisionRuntime:
    """A family's vision tower and preprocessing (vision/families.py, vision/qwen.py), the encoder
    cache and the counters /health shows."""

    def __init__(self, family: Any, limits: ImageLimits, encoder_cache_bytes: int):
        self.family = family
        self.limits = limits
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self._lock = threading.Lock()  # guards the counters below
        self.image_encodes = 0  # vision-tower runs (one per image not in the encoder cache)
        self.encode_s = 0.0
        self.vision_prefills = 0  # requests prefilled from embeddings (their images were not all cached)

    # --- HTTP threads: no MLX --------------------------------------------------------------------

    @property
    def marker(self) -> str:
        return self.family.marker

    def images(self, refs: Sequence[ImageRef]) -> list[tuple[bytes, Any]]:
        """(digest, preprocessed pixels) of each image part, in order; 4xx naming a bad part."""
        check_count(list(refs), self.limits)
        out = []
        for ref in refs:
            image = decode_image(ref, self.limits)
            try:
                pixels = self.family.preprocess(image)
            except InvalidRequestError as exc:  # a family's bound (e.g. Qwen2-VL's aspect ratio): name the part
                raise InvalidRequestError(f"{ref.where}: {exc.message}", param=exc.param) from None
            out.append((pixel_digest(pixels), pixels))
        return out

    def build(self, rendered: list[int], images: Sequence[tuple[bytes, Any]]) -> VisionPrompt:
        """The prompt whose chat template rendered one marker token per image (in order) into
        `rendered`: each marker expanded into the image's placeholder tokens. InvalidRequestError
        when the markers and the images do not pair up (e.g. the marker typed as text)."""
        family = self.family
        at = [i for i, t in enumerate(rendered) if t == family.marker_token]
        if len(at) != len(images) or family.image_token in rendered:
            raise InvalidRequestError(
                f"the prompt holds {len(at)} image markers for {len(images)} images: "
                f"the text may not contain {family.marker!r} or the image token itself"
            )
        tokens: list[int] = []
        keys: list[int] = []
        spans = []
        last = 0
        for position, (digest, pixels) in zip(at, images, strict=True):
            expansion, offset, num = family.placeholder(pixels)
            tokens += rendered[last:position]
            keys += rendered[last:position]
            start = len(tokens) + offset
            spans.append(ImageSpan(start, num, digest, pixels))
            tokens += expansion
            keys += expansion[:offset] + content_keys(digest, num) + expansion[offset + num :]
            last = position + 1
        tokens += rendered[last:]
        keys += rendered[last:]
        return VisionPrompt(tokens, keys, tuple(spans))

    # --- the MLX worker --------------------------------------------------------------------------

    def features(self, span: ImageSpan) -> mx.array:
        """The image's vision-tower output, from the encoder cache or computed (and kept)."""
        cached = self.encoder_cache.get(span.digest)
        if cached is not None:
            return cached
        started = time.perf_counter()
        features = self.family.encode(span.pixels)
        mx.eval(features)
        with self._lock:
            self.image_encodes += 1
            self.encode_s += time.perf_counter() - started
        self.encoder_cache.put(span.digest, features)
        return features

    def rope_delta(self, images: Sequence[ImageSpan]) -> int | None:
        """How far past its index the token after `images` sits (M-RoPE families; recomputed from
        the spans on every start, never stored: vision/qwen.py says why); None for plain positions,
        an int (0 for a text prompt) where every request's batch cache must be shifted by it."""
        return self.family.rope_delta(images)

    def needs_prefill(self, images: Sequence[ImageSpan], cached: int) -> bool:
        """Whether some image token lies past the cached prefix (else the batch prefills plain text)."""
        return any(span.end > cached for span in images)

    def prefill(
        self,
        model: Any,
        cache: list[Any],
        tokens: Sequence[int],
        images: Sequence[ImageSpan],
        start: int,
        step: int,
        stops: Sequence[int] = (),
        on_stop: Callable[[int], None] | None = None,
    ) -> int:
        """Run tokens[start:-1] through `model` on `cache` (which holds tokens[:start]) from input
        embeddings, in chunks of `step`, ending a chunk at each of `stops` and calling `on_stop`
        there (checkpoints). Returns the position reached: len(tokens) - 1 (the last token is left
        for the batch: its logits pick the first generated token)."""
        end = len(tokens) - 1
        if start >= end:
            return start
        needed = [s for s in images if s.end > start and s.start < end]
        features = {s.start: self.features(s) for s in needed}
        cuts = sorted({*range(start + step, end, step), *(p for p in stops if start < p < end), end})
        position = start
        for cut in cuts:
            pieces = []
            for s in needed:
                lo, hi = max(s.start, position), min(s.end, cut)
                if lo < hi:
                    pieces.append((lo - position, features[s.start][lo - s.start : hi - s.start]))
            chunk = list(tokens[position:cut])
            embeddings = self.family.embed(model, chunk, pieces)
            with self.family.positioned(model, images, position, cut):  # M-RoPE families: 3-D positions
                model(mx.array(chunk)[None], cache=cache, input_embeddings=embeddings)
            mx.eval([c.state for c in cache])
            position = cut
            if on_stop is not None and cut in stops:
                on_stop(cut)
        with self._lock:
            self.vision_prefills += 1
        return position

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = {
                "family": self.family.name,
                "image_encodes": self.image_encodes,
                "image_encode_s": round(self.encode_s, 3),
                "vision_prefills": self.vision_prefills,
            }
        return {**out, **self.encoder_cache.stats()}


def build_runtime(family: Any, config: Any) -> VisionRuntime:
    """The runtime for a loaded family under `config` (config.Config: [vision] and [server])."""
    v = config.vision
    fetch_urls, fetch_private = config.server.fetch_image_urls, config.server.fetch_private_urls
    limits = ImageLimits(
        v.max_images, v.max_image_bytes, v.max_image_pixels, fetch_urls, v.fetch_timeout_s, fetch_private
    )
    return VisionRuntime(family, limits, v.encoder_cache_bytes)
