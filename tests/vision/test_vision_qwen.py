"""Qwen2-VL images cached like text, on a tiny random-weight Qwen2-VL built from mlx-vlm's classes
(scripts/features.py tiny-vlm --family qwen2_vl). M-RoPE puts the tokens after an image at index +
rope_delta: the greedy tokens of an image + text prompt are mlx-vlm's own, and the same cold, from
RAM, from the SSD after a restart and batched with prompts of other deltas; a different image with
the same text never gets the first image's KV; the same image elsewhere shares nothing before it.
Engine-level (no server). Never weaken these tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kvharness import close_ssd, make_generator
from mlx_lm.utils import load

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.vision import runtime as vision_runtime
from mlx_kvserve.vision.families import load_family, pixel_digest
from mlx_kvserve.vision.images import ImageLimits
from mlx_kvserve.vision.runtime import VisionRuntime

pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (pyproject extra 'vision')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from harness import tiny_vlm  # noqa: E402

BS = 8
MAX_TOKENS = 8
TEXT = "Describe the picture in detail, please: what is in it?"
WIDE, TALL = (80, 112), (112, 56)  # (height, width): 3x4 and 4x2 soft tokens, rope_delta -8 and -4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tiny_vlm.build(tmp_path_factory.mktemp("qwen"), "qwen2_vl", image_size=112)
    model, tokenizer = load(str(folder))
    family = load_family(folder, json.loads((folder / "config.json").read_text()), tokenizer)
    return folder, model, tokenizer, family


def image(seed: int, size: tuple[int, int] = WIDE):
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.clip(rng.integers(0, 256, 3) + rng.normal(0, 20, (*size, 3)), 0, 255)
    return Image.fromarray(pixels.astype("uint8"))


def make_request(rt: VisionRuntime, tokenizer, images: list, text: str = TEXT, before: str = "Look:"):
    content = f"{before} {rt.marker * len(images)} {text}"
    rendered = list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
    pixels = [rt.family.preprocess(img) for img in images]
    prompt = rt.build(rendered, [(pixel_digest(p), p) for p in pixels])
    events: list = []
    req = GenerationRequest("t", prompt.tokens, SamplingParams(max_tokens=MAX_TOKENS), events.append)
    req.images, req.cache_tokens = prompt.images, prompt.cache_tokens
    req.events = events  # type: ignore[attr-defined]
    return req


def run(gen, req) -> tuple[tuple[int, ...], int]:
    gen.run(req)
    done = req.events[-1]
    assert isinstance(done, Finished), req.events
    return done.token_ids, done.usage.cached_tokens


def stack(vlm, ssd_dir=None, step: int = 32):
    _, model, tokenizer, family = vlm
    gen = make_generator(model, tokenizer, BS, ssd_dir=ssd_dir, prefill_step_size=step)
    rt = VisionRuntime(family, ImageLimits(), 1 << 26)
    gen.scheduler.vision = rt
    return gen, rt


def cold(vlm, images: list, **kw) -> tuple[int, ...]:
    gen, rt = stack(vlm, step=512)
    return run(gen, make_request(rt, vlm[2], images, **kw))[0]


def mlx_vlm_greedy(folder: Path, req, family) -> list[int]:
    """mlx-vlm's own Qwen2-VL: its get_rope_index positions, its rope_deltas while decoding."""
    from mlx_vlm.models.cache import KVCache
    from mlx_vlm.utils import load_model

    ref = load_model(folder)
    patches, grids = [], []
    for span in req.images:
        t, h, w = family.grid(span.pixels)
        m, p = family.merge, family.patch
        x = np.repeat(span.pixels[None], 2, axis=0).reshape(1, 2, 3, h // m, m, p, w // m, m, p)
        patches.append(x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(h * w, -1))
        grids.append([t, h, w])
    cache = [KVCache() for _ in ref.language_model.layers]
    ids = mx.array(req.prompt_tokens)[None]
    pixels = mx.array(np.concatenate(patches))
    logits = ref(ids, pixel_values=pixels, image_grid_thw=mx.array(grids), cache=cache).logits
    out = [int(mx.argmax(logits[0, -1]))]
    while len(out) < MAX_TOKENS:
        out.append(int(mx.argmax(ref.language_model(mx.array([[out[-1]]]), cache=cache).logits[0, -1])))
    return out


def test_greedy_tokens_are_mlx_vlms(vlm):
    """Our prefill (3-D positions) and the batch's decoding (cache length + rope_delta) give what
    mlx-vlm's model gives, for one image and for two images of different grids."""
    folder, _, tokenizer, family = vlm
    for images in ([image(1)], [image(1), image(2, TALL)]):
        gen, rt = stack(vlm, step=7)  # chunks that cut the images
        req = make_request(rt, tokenizer, images)
        tokens, _ = run(gen, req)
        assert list(tokens) == mlx_vlm_greedy(folder, req, family)[: len(tokens)]
        assert len(tokens) >= MAX_TOKENS // 2


def test_cold_ram_batched_and_swapped_image(vlm):
    _, _, tokenizer, _ = vlm
    a, b = image(1), image(2)
    cold_a, cold_b = cold(vlm, [a]), cold(vlm, [b])
    assert cold_a != cold_b  # the image matters to the output

    gen, rt = stack(vlm)
    assert run(gen, make_request(rt, tokenizer, [a]))[0] == cold_a
    req = make_request(rt, tokenizer, [a])
    tokens, cached = run(gen, req)
    assert tokens == cold_a and cached > req.images[0].end  # RAM hit past the image
    # The same text with another image: no hit from the image's first token on, and b's own answer.
    swapped = make_request(rt, tokenizer, [b])
    tokens, cached = run(gen, swapped)
    assert cached <= swapped.images[0].start and tokens == cold_b

    # Batched: prompts of rope_delta -8, -8, -12 (two images) and 0 (text) together, one of them a hit.
    two = [image(3), image(4, TALL)]
    cold_two, text_only = cold(vlm, two), cold(vlm, [])
    reqs = [make_request(rt, tokenizer, imgs) for imgs in ([a], [b], two, [])]
    for r in reqs:
        gen.scheduler.admit(r)
    while gen.scheduler.has_work:
        gen.scheduler.step()
    assert [r.events[-1].token_ids for r in reqs] == [cold_a, cold_b, cold_two, text_only]
    assert reqs[0].events[-1].usage.cached_tokens > reqs[0].images[0].end


def test_without_the_rope_delta_a_hit_decodes_elsewhere(vlm, monkeypatch):
    """The shift is what keeps a hit right: decoding after the cached image at plain positions
    (rope_delta 0) gives other tokens than the cold run."""
    _, _, tokenizer, family = vlm
    a = image(5)
    want = cold(vlm, [a])
    gen, rt = stack(vlm)
    run(gen, make_request(rt, tokenizer, [a]))
    monkeypatch.setattr(family, "rope_delta", lambda images: 0)
    tokens, cached = run(gen, make_request(rt, tokenizer, [a]))
    assert cached > 0 and tokens != want


def test_without_content_keys_a_swapped_image_would_hit(vlm, monkeypatch):
    """The guard above is what stops a wrong hit: with the placeholder ids as the image's keys (no
    digest in the chain), the swapped image hits the first image's blocks."""
    _, _, tokenizer, family = vlm
    gen, rt = stack(vlm)
    monkeypatch.setattr(vision_runtime, "content_keys", lambda digest, n: [family.image_token] * n)
    run(gen, make_request(rt, tokenizer, [image(1)]))
    swapped = make_request(rt, tokenizer, [image(2)])
    assert run(gen, swapped)[1] > swapped.images[0].end


def test_ssd_hit_after_restart(vlm, tmp_path):
    _, _, tokenizer, _ = vlm
    two = [image(6), image(7, TALL)]
    want = cold(vlm, two)
    gen, rt = stack(vlm, ssd_dir=tmp_path)
    assert run(gen, make_request(rt, tokenizer, two))[0] == want
    assert close_ssd(gen)
    gen, rt = stack(vlm, ssd_dir=tmp_path)  # a restart: empty RAM, the SSD folder kept
    req = make_request(rt, tokenizer, two)
    tokens, cached = run(gen, req)
    assert tokens == want and cached > req.images[-1].end
    assert rt.image_encodes == 0  # every image token came from the SSD: no encoder call
    close_ssd(gen)


def test_same_image_at_another_position(vlm):
    """The keys depend on the image only: after other text the same image shares nothing before
    it, its output is that prompt's own (cold) output, and its features come from the encoder cache."""
    _, _, tokenizer, _ = vlm
    gen, rt = stack(vlm)
    a = image(8)
    run(gen, make_request(rt, tokenizer, [a], before="One two three four five six seven eight nine ten:"))
    req = make_request(rt, tokenizer, [a], before="Look:")
    tokens, cached = run(gen, req)
    assert tokens == cold(vlm, [a], before="Look:") and cached <= req.images[0].start
    assert rt.image_encodes == 1 and rt.encoder_cache.hits == 1
