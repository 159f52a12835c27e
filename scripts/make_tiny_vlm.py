"""Build a tiny random-weight vision-language model folder from mlx-vlm's own classes (the CLI of harness/tiny_vlm.py).

    python scripts/make_tiny_vlm.py --family gemma3 OUT_DIR
    python scripts/make_tiny_vlm.py --family qwen2_vl --image-size 112 OUT_DIR

The folder holds config.json, model.safetensors (mlx-vlm's parameter names: vision_tower.*,
multi_modal_projector.*, language_model.*), preprocessor_config.json and the byte-level tokenizer of
scripts/harness/synthetic.py with the family's image tokens added; `mlx-kvserve run --model OUT_DIR`
serves it. qwen2_vl folders also load in mlx-vlm itself (its processor reads preprocessor_config.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.tiny_vlm import FAMILIES, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
    print(build(args.out_dir, args.family, args.seed, args.window, args.mm_tokens, args.image_size))


if __name__ == "__main__":
    main()
