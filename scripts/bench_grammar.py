"""Constrained decoding cost: the time llguidance's mask takes per generated token (issue 13, item 2).

On SmolLM2's 49,152-token vocabulary: a JSON schema's processor (engine/sampling/constrain.py) is driven through a
valid document token by token, as the batch drives it, and each call is timed (mask computation, bit
unpacking and applying it to a logits row), next to one decode step of the model for scale.

`--compare` also sets llguidance, outlines-core and xgrammar side by side on the same tokenizer and schemas
(the library choice of issue 13): grammar compile time, per-token mask time (fill the bitmask for the current
state, then advance by the next token of a fixed valid document), applying a bitmask to MLX logits, import
time (and whether torch comes with it) and which schema features each one enforces. outlines-core and
xgrammar are not project dependencies: they are imported only here, and reported as not installed when
missing. Rounds alternate the libraries' order; the figures are medians over rounds.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_grammar.py [--compare [--rounds 5]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
from harness import ROOT, default_model_dir
from harness.grammar_compare import DOCUMENT, SCHEMA, compact, compare, p90
from harness.reports import write_report

from mlx_kvserve.engine.sampling.constrain import Grammars


def measure_processor(model: Any, tokenizer: Any) -> tuple[dict, list[str]]:
    """The project's processor (mask, bit unpacking, applying it) per token, and one decode step."""
    from mlx_lm.models.cache import make_prompt_cache

    start = time.perf_counter()
    grammars = Grammars(tokenizer)
    setup_s = time.perf_counter() - start
    tokens = tokenizer.encode(compact(DOCUMENT))
    prompt = tokenizer.encode("Describe her as JSON:")
    logits = mx.zeros((1, model.args.vocab_size))
    times = []
    for _ in range(3):
        processor = grammars.processor(SCHEMA)
        context = list(prompt)
        for token in tokens:
            t0 = time.perf_counter()
            out = processor(mx.array(context), logits)
            mx.eval(out)
            times.append(time.perf_counter() - t0)
            assert out[0, token].item() == 0.0, f"the schema refused token {token}"
            context.append(token)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    steps = []
    for token in tokens[:20]:
        t0 = time.perf_counter()
        mx.eval(model(mx.array([[token]]), cache=cache))
        steps.append(time.perf_counter() - t0)
    mask_ms, step_ms = statistics.median(times) * 1e3, statistics.median(steps) * 1e3
    lines = [
        "| vocabulary | tokenizer setup (s) | mask per token, median (ms) | p90 (ms) | SmolLM2 decode step (ms) | "
        "mask / step |",
        "|---|---|---|---|---|---|",
        f"| {model.args.vocab_size} | {setup_s:.2f} | {mask_ms:.2f} | "
        f"{p90(times) * 1e3:.2f} | {step_ms:.1f} | {mask_ms / step_ms:.0%} |",
    ]
    return {"mask_ms": mask_ms, "step_ms": step_ms, "setup_s": setup_s}, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", action="store_true", help="llguidance, outlines-core and xgrammar side by side")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the comparison (alternating order)")
    args = ap.parse_args()
    from mlx_lm.utils import load

    model, tokenizer = load(str(default_model_dir()))
    results, lines = measure_processor(model, tokenizer)
    if args.compare:
        vocab = model.args.vocab_size
        results["compare"], more = compare(tokenizer._tokenizer, vocab, tokenizer.eos_token_id, args.rounds)
        lines += more
    write_report(results, ROOT / "results" / "grammar", lines)


if __name__ == "__main__":
    main()
