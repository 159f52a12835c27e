"""A cold prefill on the CPU with MLX's attention and with the server's (cpu/attention.py).

In one process, alternating: the default model (or `--model`) prefills a prompt of `--tokens` in
chunks of `--step`, through mlx-lm's plain cache (its "causal" mask) and through its batch cache (a
boolean mask array, as the server's batch uses), with MLX's `scaled_dot_product_attention`, with the
server's (its softmax in NumPy, `--rows` query rows per causal block) on every call, and with the server's
as `mlx-kvserve run` installs it for this model ("as installed": not below MIN_LAYERS layers,
cpu/attention.py; a one-layer model shows why). Reports the best of `--reps` times, the ratios to MLX's, and how far the last logits
differ from MLX's (and whether their argmax agrees).

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_cpu_prefill.py [--tokens 470,1500]
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

from mlx_kvserve.cpu import attention as cpu_attention


def prefill(model, tokens: mx.array, step: int, batch: bool) -> tuple[float, mx.array]:
    """Seconds to prefill `tokens` chunk by chunk on a fresh cache, and the last position's logits."""
    cache = [BatchKVCache([0]) for _ in model.layers] if batch else make_prompt_cache(model)
    start = time.perf_counter()
    for a in range(0, tokens.shape[1], step):
        logits = model(tokens[:, a : a + step], cache=cache)
        mx.eval([c.state for c in cache])  # the chunk's logits are not needed (never computed)
    mx.eval(logits[0, -1])
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
    layers = len(model.layers)
    variants = {
        "mlx": (0, "mlx"),
        "numpy softmax": (args.rows, "numpy"),
        "as installed": (args.rows, "numpy", layers),
    }
    names = list(variants)
    results: list[dict] = []
    lines = [
        "| prompt tokens | cache (mask) | "
        + " | ".join(f"{n} s" for n in names)
        + " | ratios to mlx | max logit diff | same argmax |",
        "|---|---|" + "---|" * (len(names) + 3),
    ]
    for n in (int(t) for t in args.tokens.split(",")):
        tokens = mx.array([[(i * 7919) % (vocab - 8) + 4 for i in range(n)]])  # ids the model has
        for batch in (False, True):
            times: dict[str, list[float]] = {name: [] for name in names}
            logits = {}
            for rep in range(args.reps):  # alternated, so a load change on the machine falls on all
                for name in names if rep % 2 == 0 else names[::-1]:
                    cpu_attention.install(*variants[name])
                    t, logits[name] = prefill(model, tokens, args.step, batch)
                    times[name].append(t)
            cpu_attention.uninstall()
            diff = max(mx.abs(logits["mlx"] - logits[name]).max().item() for name in names[1:])
            same = all(mx.argmax(logits["mlx"]).item() == mx.argmax(logits[name]).item() for name in names[1:])
            best = {k: min(v) for k, v in times.items()}
            kind = "batch cache (boolean array)" if batch else 'plain cache ("causal")'
            results.append({"tokens": n, "cache": kind, "times": times, "max_logit_diff": diff, "same_argmax": same})
            ratios = " / ".join(f"{best[name] / best['mlx']:.2f}x" for name in names[1:])
            cells = " | ".join(f"{best[name]:.3f}" for name in names)
            lines.append(f"| {n} | {kind} | {cells} | {ratios} | {diff:.1e} | {same} |")
            print(lines[-1], flush=True)
    write_report({"step": args.step, "rows": args.rows, "runs": results}, Path(args.out), lines)


if __name__ == "__main__":
    main()
