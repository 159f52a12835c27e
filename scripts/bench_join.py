"""One client's cached turn: what joining mlx-lm's batch costs, next to mlx-lm's own one-cache path.

In process (no HTTP), SmolLM2 (or --model), SSD off: a ~`words`-word prefix is computed once, then
each rep asks a new question after it (a RAM hit up to the question) and times the engine's TTFT
(lookup, assembly, joining the batch, the question's prefill, the first token). Variants, alternated
rep by rep in one process:
- `join in place`: the product (an assembled prefix joining alone becomes the batch's cache around
  its own arrays, with room for the question: kv/blocks.py `_merge_alone`);
- `merge copy`: mlx-lm's `BatchKVCache.merge` as it is (the prefix copied into a new array of exactly
  its length, then copied again when the question's prefill grows it): the code before this change;
- `mlx-lm one cache`: what `mlx_lm.server` does for one conversation: a deep copy of the prompt cache
  holding the prefix, then `stream_generate` on the question (the serial floor: no blocks, no batch).
Next to them, the physical floor measured in the same run: one copy of the prefix's KV bytes (what
assembling a hit must move), one read of them (what the question's attention must read), and the
question's forward pass over a cache that already holds the prefix (the model's compute, no copy).

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_join.py [--words 1400] [--reps 4]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

from harness import ROOT
from harness.prompts import system_prompt
from harness.reports import write_report
from harness.restart import served_ttft

VARIANTS = ("join in place", "merge copy", "mlx-lm one cache")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the default model)")
    p.add_argument("--synthetic", help="a random float32 llama of this harness shape instead, e.g. kv-heavy")
    p.add_argument("--words", type=int, default=1400)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--out", default=str(ROOT / "results" / "join"))
    args = p.parse_args(argv)

    import mlx.core as mx
    from harness.synthetic import load_bench_model
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.kv import blocks

    loaded = load_bench_model(args.model, args.synthetic, "join-")
    tok = loaded.tokenizer
    prefix = tok.encode(system_prompt("join", target_words=args.words))
    engine = Engine(loaded, load_config(overrides={"ssd": {"enabled": False}, "speculative": {"mode": "off"}}))
    engine.start()
    served_ttft(engine, prefix + tok.encode(" Warm up."))  # computes and caches the prefix
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    one_cache = make_prompt_cache(loaded.model)  # the prefix's KV in one mlx-lm cache: a variant and a floor
    for _ in stream_generate(loaded.model, tok, prefix, max_tokens=1, prompt_cache=one_cache):
        pass
    held = one_cache[0].offset
    kv_bytes = kv_bytes_per_token(loaded.model) * len(prefix)
    in_place = blocks._merge_alone
    times: dict[str, list[float]] = {v: [] for v in [*variants, *FLOORS]}
    cached: dict[str, list[int]] = {v: [] for v in variants if v != "mlx-lm one cache"}
    try:
        for rep in range(args.reps):
            for name, seconds in floor_times(kv_bytes, len(loaded.model.layers)).items():
                times[name].append(seconds)
            question = tok.encode(f" Question {rep} for {variants[0]}: which river is the longest?")  # as long
            times[FLOORS[2]].append(forward_seconds(loaded.model, one_cache, held, question))
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                question = tok.encode(f" Question {rep} for {variant}: which river is the longest?")
                if variant == "mlx-lm one cache":
                    start = time.perf_counter()
                    cache = copy.deepcopy(one_cache)
                    for _ in stream_generate(loaded.model, tok, question, max_tokens=1, prompt_cache=cache):
                        break
                    times[variant].append(time.perf_counter() - start)
                    continue
                blocks._merge_alone = in_place if variant == "join in place" else (lambda merge, caches: merge(caches))
                ttft, hit = served_ttft(engine, prefix + question)
                times[variant].append(ttft)
                cached[variant].append(hit)
    finally:
        blocks._merge_alone = in_place
        engine.stop()
    medians = {v: statistics.median(ts) for v, ts in times.items()}
    base_name = next(v for v in ("mlx-lm one cache", FLOORS[0]) if v in medians)
    lines = [
        "# One client's cached turn: joining the batch",
        "",
        f"{loaded.name}, prefix {len(prefix)} tokens ({kv_bytes / 2**30:.2f} GiB of KV), a new question each rep, "
        f"{args.reps} reps alternated, medians; mx {mx.__version__} on {mx.default_device()}",
        "",
        f"| variant | TTFT s (median) | all reps | cached tokens | / {base_name} |",
        "|---|---|---|---|---|",
        *(
            f"| {v} | {medians[v]:.3f} | {', '.join(f'{t:.3f}' for t in times[v])} | "
            f"{cached[v][0] if v in cached else '-'} | {medians[v] / medians[base_name]:.2f}x |"
            for v in times
        ),
    ]
    results = {"prefix_tokens": len(prefix), "kv_bytes": kv_bytes, "times": times, "cached": cached}
    results["medians"] = medians
    write_report(results, Path(args.out), lines)
    return results


FLOORS = ("floor: one copy of the KV", "floor: one read of the KV", "floor: the question's forward, KV in place")


def forward_seconds(model, cache, held: int, question: list[int]) -> float:
    """The question's forward pass over a cache already holding the prefix (no copy, no lookup, no
    batch: the compute every server does for a new question), then the cache cut back to the prefix."""
    import mlx.core as mx

    start = time.perf_counter()
    mx.eval(model(mx.array([question]), cache=cache)[:, -1, :])
    seconds = time.perf_counter() - start
    for c in cache:
        c.trim(c.offset - held)
    return seconds


def kv_bytes_per_token(model) -> int:
    """Keys and values of every layer for one token, in the model's dtype."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[1]]), cache=cache)
    return sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in cache)


def floor_times(num_bytes: int, layers: int) -> dict[str, float]:
    """Seconds for one copy and one read of `num_bytes` (float32) on this machine, now, held as the
    cache holds them: keys and values of each of `layers` layers, one array each."""
    import mlx.core as mx

    sources = [mx.random.normal((num_bytes // (8 * layers),)) for _ in range(2 * layers)]
    mx.eval(sources)
    start = time.perf_counter()
    copies = [a + 0 for a in sources]  # reads every byte and writes as many: a copy
    mx.eval(copies)
    copied = time.perf_counter() - start
    del copies
    start = time.perf_counter()
    mx.eval([a.sum() for a in sources])
    read = time.perf_counter() - start
    return {FLOORS[0]: copied, FLOORS[1]: read}


if __name__ == "__main__":
    from mlx_kvserve.clean_exit import serve_then_exit

    serve_then_exit(main)  # the engine's worker made MLX streams: exit without MLX's abort at teardown
