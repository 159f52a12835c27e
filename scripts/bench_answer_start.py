"""A new question on a cached prompt: its first tokens, not only the first (issue 26).

In process (no HTTP), SSD off, the server's other defaults (speculative decoding "auto"): a
~`words`-word prefix is computed once, then each rep asks a new question after it (a RAM hit up to the
question) for `tokens` greedy tokens, and times each token from the submission. Between the first
token and the second the engine registers the prompt's new blocks, and a request alone may move to
the speculative path; both used to copy the request's whole KV out of mlx-lm's batch (its `extract`),
the speculative path once more to grow it. Variants, alternated rep by rep in one process:
- `borrowed` (the product): the blocks cut from views of the batch's arrays, a lone request taking
  the batch's arrays themselves onto the speculative path (kv/blocks.py `borrowed_row`);
- `copied`: mlx-lm's `extract` (the code before);
- `borrowed without speculation`: the product with the speculative path off (what it costs or saves here).
Next to them, in the same run: one copy of the prefix's KV bytes (what each extraction moved).

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_answer_start.py
           [--synthetic kv-heavy] [--words 800] [--tokens 6] [--reps 4]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from harness import ROOT
from harness.prompts import system_prompt
from harness.reports import write_report
from harness.restart import served_token_times

VARIANTS = ("borrowed", "copied", "borrowed without speculation")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the default model, unless --synthetic)")
    p.add_argument("--synthetic", default="kv-heavy", help="a random float32 llama of this harness shape ('' = none)")
    p.add_argument("--words", type=int, default=800)
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--out", default=str(ROOT / "results" / "answer_start"))
    args = p.parse_args(argv)

    from harness.synthetic import load_bench_model

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.batch import mlx_batch as batch_generator
    from mlx_kvserve.engine.engine import Engine

    loaded = load_bench_model(args.model, args.synthetic, "answer-")
    tok = loaded.tokenizer
    prefix = tok.encode(system_prompt("answer", target_words=args.words))
    engine = Engine(loaded, load_config(overrides={"ssd": {"enabled": False}}))
    engine.start()
    scheduler = engine.generator.scheduler
    speculation = scheduler.speculation
    borrowed = batch_generator.borrowed_row
    served_token_times(engine, prefix + tok.encode(" Warm up."), 2)  # computes and caches the prefix
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    copies: list[float] = []
    try:
        for rep in range(args.reps):
            copies.append(copy_seconds(scheduler, prefix))
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                batch_generator.borrowed_row = borrowed if variant != "copied" else extracted
                scheduler.speculation = None if variant.endswith("without speculation") else speculation
                # As long for every variant (the same number of new tokens to prefill).
                question = tok.encode(f" Question {rep}{'abc'[VARIANTS.index(variant)]}: which river is the longest?")
                token_times, _ = served_token_times(engine, prefix + question, args.tokens)
                times[variant].append(token_times)
    finally:
        batch_generator.borrowed_row = borrowed
        scheduler.speculation = speculation
        engine.stop()
    lines = report(loaded.name, len(prefix), args, times, copies, speculation)
    results = {"prefix_tokens": len(prefix), "times": times, "copy_s": copies}
    write_report(results, Path(args.out), lines)
    return results


def extracted(c, idx, whole=False):
    """mlx-lm's extraction of a row (a copy of its whole KV): the code before."""
    return c.extract(idx)


def copy_seconds(scheduler, prefix: list[int]) -> float:
    """One copy of the prefix's KV as the cache holds it (the worker idle meanwhile)."""
    import time

    import mlx.core as mx

    layout = scheduler.prefix_cache.layout
    probe = layout.new_cache()
    mx.eval(layout.model(mx.array([prefix[:1]]), cache=probe))
    per_token = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in probe)
    sources = [mx.random.normal((per_token * len(prefix) // (8 * len(probe)),)) for _ in range(2 * len(probe))]
    mx.eval(sources)
    start = time.perf_counter()
    mx.eval([a + 0 for a in sources])
    return time.perf_counter() - start


def report(name: str, prefix_tokens: int, args, times: dict, copies: list[float], speculation) -> list[str]:
    def median_at(variant: str, i: int) -> float:
        return statistics.median(ts[i] for ts in times[variant] if len(ts) > i)

    n = args.tokens
    mode = speculation.describe().get("mode", "?") if speculation is not None else "off"
    lines = [
        "# A new question on a cached prompt: its first tokens",
        "",
        f"{name}, prefix {prefix_tokens} tokens, {n} greedy tokens per question, {args.reps} reps alternated, "
        f"medians, seconds from submission; speculative mode {mode}; one copy of the prefix's KV "
        f"{statistics.median(copies):.3f} s in the same run",
        "",
        f"| variant | token 1 | token 2 | token {n} | token {n} per rep |",
        "|---|---|---|---|---|",
    ]
    for v, reps in times.items():
        per_rep = ", ".join(f"{ts[-1]:.3f}" for ts in reps if ts)
        lines.append(f"| {v} | {median_at(v, 0):.3f} | {median_at(v, 1):.3f} | {median_at(v, n - 1):.3f} | {per_rep} |")
    return lines


if __name__ == "__main__":
    from mlx_kvserve.clean_exit import serve_then_exit

    serve_then_exit(main)  # the engine's worker made MLX streams: exit without MLX's abort at teardown
