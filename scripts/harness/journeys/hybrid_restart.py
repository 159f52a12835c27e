"""A user's restart of a hybrid model, end to end (issue 23, first step 1).

Builds a tiny random-weight model of an mlx-lm family (harness.synthetic.FAMILY_CONFIGS)
with SmolLM2's tokenizer, then does what a user does: `mlx-kvserve run` as a process, an 848-token
system prompt + question asked cold, the same again, another question under the same system prompt;
SIGTERM and wait for the exit; a new process on the same home folder; the first question again.
Prints each reply's cached tokens and whether the reply after the restart equals the cold one.

    .venv/bin/python scripts/journeys.py hybrid-restart [family ...]   (default: qwen3_5 nemotron_h lfm2)

Exits 1 when the restarted server misses what the first one held for the system prompt (the cached
tokens of the other question) or its greedy reply differs from the cold one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from harness.journey import run_journey

SMOLLM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_model(folder: Path, family: str, tokenizer_dir: Path) -> Path:
    """A tiny random `family` model whose vocabulary and tokenizer are SmolLM2's (copied from
    `tokenizer_dir`, the default model's folder)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from harness.synthetic import family_config, random_model

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = family_config(family, vocab_size=vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in SMOLLM_TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(random_model(config).parameters())))
    return folder


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("families", nargs="*", default=["qwen3_5", "nemotron_h", "lfm2"])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders (models, homes, logs)")


def run(args: argparse.Namespace) -> int:

    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.default import ensure_default_model

    smollm = ensure_default_model(default_home() / "models", "float32")
    work = Path(tempfile.mkdtemp(prefix="journey-hybrid-"))
    failed = []
    for family in args.families:
        model = build_model(work / family / "model", family, smollm)
        journey = run_journey(model, work / family / "home")
        print(f"== {family}: prompt {journey.cold.prompt_tokens} tokens")
        for name in ("cold", "again", "other", "restarted"):
            reply = getattr(journey, name)
            print(f"  {name:<10} cached {reply.cached_tokens:>4}  {reply.text!r}")
        print(f"  SIGTERM exit {journey.shutdown_rc}; on disk after it: {journey.ssd_files}")
        verdict = "OK" if journey.ok else "FAILED"
        print(f"  {verdict}: restarted reply {'==' if journey.same_reply else '!='} cold reply")
        if not journey.ok:
            failed.append(family)
    if args.keep or failed:
        print(f"folders kept in {work}")
    else:
        shutil.rmtree(work)
    return 1 if failed else 0
