"""Images cached like text, measured in one run on a tiny random-weight Gemma 3 (make_tiny_vlm.py),
through the engine (the server's scheduler, block cache, SSD tier and vision runtime; no HTTP):

1. a first question about an image (cold), then a second question about the same image;
2. a conversation whose third turn re-sends its 3 earlier images (each turn adds one);
3. the second question again after a restart (empty RAM, the SSD folder kept).

For each: time to first token, prompt and cached tokens, and vision-tower runs.

    python scripts/bench_vision.py [--mm-tokens 256 --image-size 224]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.kvstack import close_ssd, make_generator  # noqa: E402
from harness.tiny_vlm import build  # noqa: E402

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams  # noqa: E402
from mlx_kvserve.vision.families import load_family, pixel_digest  # noqa: E402
from mlx_kvserve.vision.images import ImageLimits  # noqa: E402
from mlx_kvserve.vision.runtime import VisionRuntime  # noqa: E402

BLOCK = 16


def image(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.clip(rng.integers(0, 256, 3) + rng.normal(0, 20, (480, 640, 3)), 0, 255)
    return Image.fromarray(pixels.astype("uint8"))


class Bench:
    def __init__(self, folder: Path, ssd: Path):
        from mlx_lm.utils import load

        self.model, self.tokenizer = load(str(folder))
        self.family = load_family(folder, json.loads((folder / "config.json").read_text()), self.tokenizer)
        self.ssd = ssd
        self.start()

    def start(self) -> None:
        self.gen = make_generator(self.model, self.tokenizer, BLOCK, ssd_dir=self.ssd)
        self.rt = VisionRuntime(self.family, ImageLimits(), 1 << 28)
        self.gen.scheduler.vision = self.rt

    def ask(self, turns: list[tuple[str, list]]) -> dict:
        """One request: user turns (text with an image marker per image), with short assistant replies between."""
        messages, images = [], []
        for i, (text, imgs) in enumerate(turns):
            if i:
                messages.append({"role": "assistant", "content": f"Reply {i}."})
            messages.append({"role": "user", "content": self.rt.marker * len(imgs) + text})
            images += imgs
        rendered = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        started = time.perf_counter()
        pixels = [self.family.preprocess(img) for img in images]
        prompt = self.rt.build(rendered, [(pixel_digest(p), p) for p in pixels])
        prep_s = time.perf_counter() - started  # decode, resize and hash: the HTTP thread's part
        events: list = []
        req = GenerationRequest("b", prompt.tokens, SamplingParams(max_tokens=4), events.append, images=prompt.images)
        req.cache_tokens = prompt.cache_tokens
        encodes = self.rt.image_encodes
        self.gen.run(req)
        done = events[-1]
        assert isinstance(done, Finished), events
        return {
            "ttft_ms": round((prep_s + done.first_token_s) * 1000, 2),
            "prep_ms": round(prep_s * 1000, 2),
            "prompt_tokens": done.usage.prompt_tokens,
            "cached_tokens": done.usage.cached_tokens,
            "image_encodes": self.rt.image_encodes - encodes,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mm-tokens", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "model", "gemma3", mm_tokens=args.mm_tokens, image_size=args.image_size)
        bench = Bench(folder, Path(tmp) / "kv")
        a, b, c = image(1), image(2), image(3)
        bench.ask([("Warm-up: compile the kernels first.", [image(9)])])  # shares no image with the rest
        rows = {
            "first question, image A (cold)": bench.ask([("What is in this picture?", [a])]),
            "second question, same image A": bench.ask([("What colour dominates it?", [a])]),
        }
        conversation = [("Here is the first screenshot.", [a]), ("And the second.", [b])]
        rows["conversation turn 2 (images A, B)"] = bench.ask(conversation)
        rows["conversation turn 3 re-sends A, B + new C"] = bench.ask([*conversation, ("And a third.", [c])])
        close_ssd(bench.gen)
        bench.start()  # a restart: empty RAM (blocks and encoder cache), the SSD folder kept
        rows["after restart: second question, image A"] = bench.ask([("What colour dominates it?", [a])])
        close_ssd(bench.gen)
    width = max(len(k) for k in rows)
    print(f"{'scenario':<{width}}  ttft_ms  prep_ms  prompt  cached  encodes")
    for name, r in rows.items():
        print(
            f"{name:<{width}}  {r['ttft_ms']:7.2f}  {r['prep_ms']:7.2f}  {r['prompt_tokens']:6d}  {r['cached_tokens']:6d}  {r['image_encodes']:7d}"
        )


if __name__ == "__main__":
    main()
