"""Images cached like text, on a tiny random-weight Gemma 3 built from mlx-vlm's classes
(scripts/features.py tiny-vlm): greedy tokens of an image + text prompt are the same cold, from RAM,
from the SSD after a restart and batched; a different image with the same text never gets the
first image's KV (the chain holds each image's content keys); the encoder cache spares re-encodes.
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
from mlx_kvserve.vision.families import load_family
from mlx_kvserve.vision.images import ImageLimits
from mlx_kvserve.vision.runtime import VisionRuntime

pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (pyproject extra 'vision')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from harness import tiny_vlm  # noqa: E402

BS = 8
MAX_TOKENS = 8
TEXT = "Describe the picture in detail, please: what is in it?"


@pytest.fixture(scope="module", params=[0, 24], ids=["global", "window24"])
def vlm(request, tmp_path_factory):
    folder = tiny_vlm.build(tmp_path_factory.mktemp("vlm"), "gemma3", window=request.param)
    model, tokenizer = load(str(folder))
    family = load_family(folder, json.loads((folder / "config.json").read_text()), tokenizer)
    return folder, model, tokenizer, family


def image(seed: int, size: tuple[int, int] = (40, 64)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    color = rng.integers(0, 256, 3)  # distinct images: a colour each, a little noise on it
    pixels = np.clip(color + rng.normal(0, 20, (*size, 3)), 0, 255)
    return Image.fromarray(pixels.astype("uint8"))


def make_request(
    rt: VisionRuntime, tokenizer, images: list, text: str = TEXT, before: str = "Look:"
) -> GenerationRequest:
    content = f"{before} {rt.marker * len(images)} {text}"
    rendered = list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
    pixels = [rt.family.preprocess(img) for img in images]
    from mlx_kvserve.vision.families import pixel_digest

    prompt = rt.build(rendered, [(pixel_digest(p), p) for p in pixels])
    events: list = []
    req = GenerationRequest(
        "t", prompt.tokens, SamplingParams(max_tokens=MAX_TOKENS), events.append, images=prompt.images
    )
    req.cache_tokens = prompt.cache_tokens
    req.events = events  # type: ignore[attr-defined]
    return req


def run(gen, req) -> tuple[tuple[int, ...], int]:
    gen.run(req)
    done = req.events[-1]
    assert isinstance(done, Finished), req.events
    return done.token_ids, done.usage.cached_tokens


def stack(vlm, ssd_dir=None, step: int = 32):
    folder, model, tokenizer, family = vlm
    gen = make_generator(model, tokenizer, BS, ssd_dir=ssd_dir, checkpoint_every=32, prefill_step_size=step)
    rt = VisionRuntime(family, ImageLimits(), 1 << 26)
    gen.scheduler.vision = rt
    return gen, rt


def test_embeddings_match_mlx_vlm(vlm):
    """Our merge of image features into the input embeddings is mlx-vlm's own (Gemma 3)."""
    folder, model, tokenizer, family = vlm
    gen, rt = stack(vlm)
    req = make_request(rt, tokenizer, [image(1)])
    from mlx_vlm.utils import load_model

    ref = load_model(folder)
    ids = mx.array(req.prompt_tokens)[None]
    pixels = mx.array(req.images[0].pixels[None])
    want = ref.get_input_embeddings(ids, pixels, mask=mx.ones_like(ids)).inputs_embeds
    span = req.images[0]
    got = family.embed(model, req.prompt_tokens, [(span.start, rt.features(span))])
    scale = family.hidden**0.5  # mlx-lm's Gemma 3 multiplies every embedding by it, mlx-vlm's too
    assert mx.allclose(got * scale, want * scale, atol=1e-4).item()


def test_cold_ram_batched_and_swapped_image(vlm):
    _, _, tokenizer, _ = vlm
    cold_gen, rt = stack(vlm, step=512)
    a, b = image(1), image(2)
    cold_a, cached = run(cold_gen, make_request(rt, tokenizer, [a]))
    assert cached == 0
    cold_b, _ = run(stack(vlm, step=512)[0], make_request(rt, tokenizer, [b]))
    assert cold_a != cold_b  # the image matters to the output

    gen, rt = stack(vlm)
    assert run(gen, make_request(rt, tokenizer, [a]))[0] == cold_a
    req = make_request(rt, tokenizer, [a])
    tokens, cached = run(gen, req)
    assert tokens == cold_a and cached > req.images[0].end  # RAM hit past the image
    encodes = rt.image_encodes
    # The same text with another image: no hit from the image's first token on, and b's own answer.
    swapped = make_request(rt, tokenizer, [b])
    tokens, cached = run(gen, swapped)
    assert cached <= swapped.images[0].start
    assert tokens == cold_b
    assert rt.image_encodes == encodes + 1

    # Batched: a, b and a text-only prompt together give what each gives alone.
    batch_gen, rt = stack(vlm)
    reqs = [make_request(rt, tokenizer, [a]), make_request(rt, tokenizer, [b]), make_request(rt, tokenizer, [])]
    text_only, _ = run(stack(vlm)[0], make_request(rt, tokenizer, []))
    for r in reqs:
        batch_gen.scheduler.admit(r)
    while batch_gen.scheduler.has_work:
        batch_gen.scheduler.step()
    got = [r.events[-1].token_ids for r in reqs]
    assert got == [cold_a, cold_b, text_only]


def test_without_content_keys_a_swapped_image_would_hit(vlm, monkeypatch):
    """The guard above is what stops a wrong hit: with the image's placeholder ids as its keys
    (no digest in the chain), the swapped image hits the first image's blocks."""
    _, _, tokenizer, family = vlm
    gen, rt = stack(vlm)
    monkeypatch.setattr(vision_runtime, "content_keys", lambda digest, n: [family.image_token] * n)
    run(gen, make_request(rt, tokenizer, [image(1)]))
    swapped = make_request(rt, tokenizer, [image(2)])
    _, cached = run(gen, swapped)
    assert cached > swapped.images[0].end


def test_ssd_hit_after_restart(vlm, tmp_path):
    _, _, tokenizer, _ = vlm
    a = image(3)
    cold, _ = run(stack(vlm, step=512)[0], make_request(rt_of(vlm), tokenizer, [a]))
    gen, rt = stack(vlm, ssd_dir=tmp_path)
    assert run(gen, make_request(rt, tokenizer, [a]))[0] == cold
    assert close_ssd(gen)
    gen, rt = stack(vlm, ssd_dir=tmp_path)  # a restart: empty RAM, the SSD folder kept
    req = make_request(rt, tokenizer, [a])
    tokens, cached = run(gen, req)
    assert tokens == cold and cached > req.images[0].end
    assert rt.image_encodes == 0  # every image token came from the SSD: no encoder call
    close_ssd(gen)


def test_encoder_cache_spares_a_reencode(vlm):
    """A conversation whose earlier text changed misses the blocks, not the image's features."""
    _, _, tokenizer, _ = vlm
    gen, rt = stack(vlm)
    a = image(4)
    run(gen, make_request(rt, tokenizer, [a], before="First:"))
    cold, _ = run(stack(vlm, step=512)[0], make_request(rt, tokenizer, [a], before="Second one:"))
    tokens, _ = run(gen, make_request(rt, tokenizer, [a], before="Second one:"))
    assert tokens == cold
    assert rt.image_encodes == 1 and rt.encoder_cache.hits == 1


def test_same_image_at_another_position(vlm):
    """The keys depend on the image only: the same image after other text shares nothing before
    it, and its output is that prompt's own (cold) output."""
    _, _, tokenizer, _ = vlm
    gen, rt = stack(vlm)
    a = image(5)
    run(gen, make_request(rt, tokenizer, [a], before="One two three four five six seven eight nine ten:"))
    req = make_request(rt, tokenizer, [a], before="Look:")
    cold, _ = run(stack(vlm, step=512)[0], make_request(rt, tokenizer, [a], before="Look:"))
    tokens, cached = run(gen, req)
    assert tokens == cold and cached <= req.images[0].start


def rt_of(vlm) -> VisionRuntime:
    return VisionRuntime(vlm[3], ImageLimits(), 1 << 26)
