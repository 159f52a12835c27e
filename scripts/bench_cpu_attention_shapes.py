"""Where the server's CPU attention (cpu/attention.py) wins over MLX's, shape by shape (issue 44).

One attention call per case, float32 on the CPU, both in one process, alternating, median of `--reps`:
- MLX's `mx.fast.scaled_dot_product_attention` with the causal mask (what mlx-lm's models call);
- the server's `attention` as `mlx-kvserve run` installs it (its softmax in NumPy where its rule says so,
  `--rows`-row causal blocks), and the path the rule took ("numpy" or "mlx").
Shapes are query heads x KV heads x head size (a layer's call; the layer count does not change it);
cases are a kind, query rows and keys: `cold` a prefill chunk whose queries are the last keys (a cold
prompt's 512-token chunk at that depth), `turn` a cached turn's new tokens over a long context, `decode`
one query row. Cases whose work (heads x rows x keys x head size) passes `--max-work` are left out.
The outputs are checked against MLX's.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_cpu_attention_shapes.py
           [--shapes 1x1x64,2x2x16,9x3x64,8x4x128,32x8x128] [--cases cold:512:4096,...] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from harness import ROOT
from harness.reports import write_report

from mlx_kvserve.cpu import attention as cpu_attention

SHAPES = "1x1x64,2x2x16,9x3x64,8x4x128,32x8x128"  # agent test model, deep-narrow, SmolLM2, kv-heavy, 8B
CASES = (
    "decode:1:512,decode:1:8192,decode:1:32768,turn:100:2048,turn:300:23000,turn:300:32768,"
    "cold:512:512,cold:512:4096,cold:512:16384,cold:512:32768"
)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]  # type: ignore[misc]


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    return [(kind, int(rows), int(keys)) for kind, rows, keys in (c.split(":") for c in text.split(","))]


def measure(shape: tuple[int, int, int], rows: int, keys: int, reps: int) -> dict:
    """MLX's and the server's attention for one call: median ms each, the path taken, the largest diff."""
    heads, kv_heads, dims = shape
    q = mx.random.normal((1, heads, rows, dims))
    k, v = mx.random.normal((1, kv_heads, keys, dims)), mx.random.normal((1, kv_heads, keys, dims))
    mx.eval(q, k, v)
    scale = dims**-0.5
    taken = {"numpy": 0}
    real_numpy = cpu_attention.numpy_softmax_attention

    def counted(*args, **kwargs):
        out = real_numpy(*args, **kwargs)
        taken["numpy"] += out is not None
        return out

    variants = {
        "mlx": lambda: cpu_attention._mlx_attention(q, k, v, scale=scale, mask="causal"),
        "ours": lambda: cpu_attention.attention(q, k, v, scale=scale, mask="causal"),
    }
    cpu_attention.numpy_softmax_attention = counted
    try:
        outs = {name: fn() for name, fn in variants.items()}  # warm-up, and the outputs compared
        mx.eval(outs)
        path = "numpy" if taken["numpy"] else "mlx"
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(reps):
            for name in variants if rep % 2 == 0 else list(variants)[::-1]:
                start = time.perf_counter()
                mx.eval(variants[name]())
                times[name].append((time.perf_counter() - start) * 1000)
    finally:
        cpu_attention.numpy_softmax_attention = real_numpy
    ms = {name: statistics.median(t) for name, t in times.items()}
    diff = mx.abs(outs["ours"] - outs["mlx"]).max().item()
    return {"mlx_ms": ms["mlx"], "ours_ms": ms["ours"], "ratio": ms["ours"] / ms["mlx"], "path": path, "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="query heads x KV heads x head size, comma-separated")
    parser.add_argument("--cases", default=CASES, help="kind:query rows:keys, comma-separated")
    parser.add_argument(
        "--rows", type=int, default=128, help="query rows per causal block ([generation] cpu_attention_rows)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-work", type=float, default=4e9, help="heads x rows x keys x head size per call")
    parser.add_argument("--out", default=str(ROOT / "results" / "cpu_attention_shapes"))
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    if not cpu_attention.install(args.rows, "numpy"):
        raise SystemExit("the CPU attention did not install (not on the CPU?)")
    runs = []
    lines = [
        f"One call, float32, CPU; the server's attention ({args.rows}-row causal blocks) against MLX's; "
        f"median of {args.reps}, alternating.",
        "",
        "| heads x KV heads x dims | kind | query rows | keys | scores | MLX ms | ours ms | ours / MLX | path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    try:
        for shape in parse_shapes(args.shapes):
            for kind, rows, keys in parse_cases(args.cases):
                if shape[0] * rows * keys * shape[2] > args.max_work:
                    continue
                run = {"shape": list(shape), "kind": kind, "rows": rows, "keys": keys}
                run |= measure(shape, rows, keys, args.reps)
                runs.append(run)
                name = "x".join(str(n) for n in shape)
                lines.append(
                    f"| {name} | {kind} | {rows} | {keys} | {shape[0] * rows * keys:,} | {run['mlx_ms']:.2f} | "
                    f"{run['ours_ms']:.2f} | {run['ratio']:.2f}x | {run['path']} |"
                )
                print(lines[-1], flush=True)
    finally:
        cpu_attention.uninstall()
    numpy_ratios = [r["ratio"] for r in runs if r["path"] == "numpy"]
    if numpy_ratios:
        lines += [
            "",
            f"NumPy path: {len(numpy_ratios)} cases, ours / MLX median {statistics.median(numpy_ratios):.2f}x, "
            f"worst {max(numpy_ratios):.2f}x; MLX path: {len(runs) - len(numpy_ratios)} cases.",
        ]
    write_report({"rows": args.rows, "reps": args.reps, "runs": runs}, Path(args.out), lines)


if __name__ == "__main__":
    main()
