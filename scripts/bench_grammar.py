"""Constrained decoding cost: the time llguidance's mask takes per generated token (issue 13, item 2).

On SmolLM2's 49,152-token vocabulary: a JSON schema's processor (engine/constrain.py) is driven through a
valid document token by token, as the batch drives it, and each call is timed (mask computation, bit
unpacking and applying it to a logits row), next to one decode step of the model for scale.

    python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_grammar.py
"""

from __future__ import annotations

import json
import statistics
import time

import mlx.core as mx
from bench_common import ROOT, default_model_dir, write_report

from mlx_kvserve.engine.constrain import Grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "engines", "notes"],
    "address": {"city": "London", "zip": "W1"},
}


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, tokenizer = load(str(default_model_dir()))
    start = time.perf_counter()
    grammars = Grammars(tokenizer)
    setup_s = time.perf_counter() - start
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tokenizer.encode(text)
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
        f"{statistics.quantiles(times, n=10)[-1] * 1e3:.2f} | {step_ms:.1f} | {mask_ms / step_ms:.0%} |",
    ]
    write_report({"mask_ms": mask_ms, "step_ms": step_ms, "setup_s": setup_s}, ROOT / "results" / "grammar", lines)


if __name__ == "__main__":
    main()
