"""A cold prefill on the CPU with MLX's attention and with the block-causal one (engine/cpu_attention.py).

In one process, alternating: the default model (or `--model`) prefills a prompt of `--tokens` in
chunks of `--step`, through mlx-lm's plain cache (its "causal" mask) and through its batch cache (a
boolean mask array, as the server's batch uses), once with MLX's `scaled_dot_product_attention` and
once with the block-causal attention (`--rows` query rows per block). Reports the best of `--reps`
times, their ratio, and how far the last logits differ (and whether their argmax agrees).

Usage: python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_cpu_prefill.py [--tokens 470,1500]
           [--step 512] [--rows 128] [--reps 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
from harness import ROOT, default_model_dir
from harness.reports import write_report
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.utils import load

from mlx_kvserve.engine import cpu_attention


def prefill(model, tokens: mx.array, step: int, batch: bool) -> tuple[float, mx.array]:
    """Seconds to prefill `tokens` chunk by chunk on a fresh cache, and the last position's logits."""
    cache = [BatchKVCache([0]) for _ in model.layers] if batch else make_prompt_cache(model)
    start = time.perf_counter()
    for a in range(0, tokens.shape[1], step):
        logits = model(tokens[:, a : a + step], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return time.perf_counter() - start, logits[0, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="470,1500", help="prompt lengths, comma-separated")
    parser.add_argument("--step", type=int, default=512, help="prefill chunk (the server's on the CPU)")
    parser.add_argument("--rows", type=int, default=128, help="query rows per block ([generation] cpu_attention_rows)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--out", default=str(ROOT / "results" / "cpu_prefill"))
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    model, tokenizer = load(args.model or str(default_model_dir()))
    vocab = tokenizer.vocab_size
    results, lines = (
        [],
        [
            "| prompt tokens | cache (mask) | MLX's attention s | block-causal s | ratio | max logit diff | same argmax |"
        ],
    )
    lines.append("|---|---|---|---|---|---|---|")
    for n in (int(t) for t in args.tokens.split(",")):
        tokens = mx.array([[(i * 7919) % (vocab - 8) + 4 for i in range(n)]])  # ids the model has
        for batch in (False, True):
            times: dict[str, list[float]] = {"mlx": [], "blocks": []}
            logits = {}
            for _ in range(args.reps):  # alternated, so a load change on the machine falls on both
                for name in ("mlx", "blocks"):
                    cpu_attention.install(args.rows if name == "blocks" else 0)
                    t, logits[name] = prefill(model, tokens, args.step, batch)
                    times[name].append(t)
            cpu_attention.uninstall()
            diff = mx.abs(logits["mlx"] - logits["blocks"]).max().item()
            same = mx.argmax(logits["mlx"]).item() == mx.argmax(logits["blocks"]).item()
            best = {k: min(v) for k, v in times.items()}
            kind = "batch cache (boolean array)" if batch else 'plain cache ("causal")'
            results.append({"tokens": n, "cache": kind, "times": times, "max_logit_diff": diff, "same_argmax": same})
            ratio = best["blocks"] / best["mlx"]
            lines.append(
                f"| {n} | {kind} | {best['mlx']:.3f} | {best['blocks']:.3f} | {ratio:.2f}x | {diff:.1e} | {same} |"
            )
            print(lines[-1], flush=True)
    write_report({"step": args.step, "rows": args.rows, "runs": results}, Path(args.out), lines)


if __name__ == "__main__":
    main()
