"""Where MLX's attention of a new question over a long cached context spends its time on this machine.

Issue 26's big-KV target (a new question on a cached ~4.3k-token prompt in under 0.5 s on the CPU)
is bound by the attention of the question's tokens over the context (docs/benchmarks-history-2026-12-07.md "The big-KV
model's new question against the physical floor"). This splits one layer's attention, on the
`kv-heavy` shape (8 query heads, 4 KV heads, 128 dims, float32) by default, into its parts, each
timed alone (median of `--reps`), next to the floor of reading the layer's KV once:
- `mx.fast.scaled_dot_product_attention` with the causal mask (what every mlx-lm model calls);
- the same attention written out: scores (GEMM), mask, softmax, weighted sum (GEMM);
- the softmax alone, and `exp` next to `add` on the same scores (element cost);
- `exp` split over two CPU streams (MLX runs one CPU stream's elementwise ops on one thread);
- two rewrites of the softmax tried against MLX's own: as powers of two (`mx.power(2, x)` costs less
  per element than `exp`, but the written-out softmax makes separate passes over the scores) and with
  the query rows halved on two CPU streams.
- the attention the server uses on the CPU (cpu/attention.py, `--block-rows`): its softmax in NumPy, a
  chunk's queries in blocks, each against the keys up to its last query (a prefill chunk's shape:
  `--new-tokens 470 --context 0 --heads 9 --kv-heads 3 --head-dim 64 --layers 30`, SmolLM2's cold prompt),
  and NumPy's softmax alone on the same scores.
The outputs of the written-out and the server's attentions are checked against the fast one. Where the
server's wins, shape by shape: scripts/bench_cpu_attention_shapes.py.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_cpu_attention.py
           [--new-tokens 55] [--context 4636] [--heads 8] [--kv-heads 4] [--head-dim 128] [--layers 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import ROOT
from harness.reports import write_report

from mlx_kvserve.cpu import attention as cpu_attention


def timed_ms(fn, *args, reps: int) -> float:
    """Median milliseconds of `fn(*args)` evaluated, after one warm-up call."""
    mx.eval(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn(*args))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=55)
    parser.add_argument("--context", type=int, default=4636, help="cached tokens before the new ones")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32, help="to scale one layer's figures to the model")
    parser.add_argument("--block-rows", type=int, default=128, help="query rows per block (cpu_attention_rows)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "results" / "cpu_attention"))
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    new, total, heads, kv_heads, dim = (
        args.new_tokens,
        args.context + args.new_tokens,
        args.heads,
        args.kv_heads,
        args.head_dim,
    )
    rep = heads // kv_heads
    scale = dim**-0.5
    q = mx.random.normal((1, heads, new, dim))
    k = mx.random.normal((1, kv_heads, total, dim))
    v = mx.random.normal((1, kv_heads, total, dim))
    visible = mx.tile(mx.arange(total - new, total)[:, None] >= mx.arange(total)[None], (rep, 1))
    mx.eval(q, k, v, visible)

    def fast(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def blocks_numpy(q, k, v):
        return cpu_attention.block_attention(q, k, v, scale=scale, mask="causal", rows=args.block_rows)

    def numpy_softmax(s):  # in place, on a copy of the scores of its own: nothing left for MLX to evaluate
        cpu_attention.softmax_in_place(np.asarray(s))

    def scores(q, k):  # each KV head's query rows stacked: one GEMM per KV head, no repeat of K
        return (q * scale).reshape(1, kv_heads, rep * new, dim) @ k.swapaxes(-1, -2)

    def written_out(q, k, v):
        probs = mx.softmax(mx.where(visible, scores(q, k), -mx.inf), axis=-1, precise=True)
        return (probs @ v).reshape(1, heads, new, dim)

    def softmax_pow2(s):  # log2(e) folded into the scores here; in an attention it goes into the scale
        s = s * 1.4426950408889634
        weights = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
        return weights * mx.reciprocal(weights.sum(axis=-1, keepdims=True))

    def softmax_two_streams(s):
        top, bottom = mx.split(s, [s.shape[-2] // 2], axis=-2)
        return [
            mx.softmax(top, axis=-1, precise=True, stream=streams[0]),
            mx.softmax(bottom, axis=-1, precise=True, stream=streams[1]),
        ]

    s = scores(q, k)
    halves = mx.split(s, [s.shape[-2] // 2], axis=-2)
    streams = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)]
    mx.eval(s, halves)
    max_diff = mx.abs(fast(q, k, v) - written_out(q, k, v)).max().item()
    numpy_diff = mx.abs(fast(q, k, v) - blocks_numpy(q, k, v)).max().item()
    pow2_diff = mx.abs(softmax_pow2(s) - mx.softmax(s, axis=-1, precise=True)).max().item()
    reps = args.reps
    rows = {
        "read the layer's KV once (floor)": timed_ms(lambda k, v: (k.sum(), v.sum()), k, v, reps=reps),
        "mx.fast.scaled_dot_product_attention": timed_ms(fast, q, k, v, reps=reps),
        f"softmax in NumPy, {args.block_rows}-row causal blocks (the server's on the CPU)": timed_ms(
            blocks_numpy, q, k, v, reps=reps
        ),
        "written out: all of it": timed_ms(written_out, q, k, v, reps=reps),
        "  scores (GEMM)": timed_ms(scores, q, k, reps=reps),
        "  mask": timed_ms(lambda s: mx.where(visible, s, -mx.inf), s, reps=reps),
        "  softmax": timed_ms(lambda s: mx.softmax(s, axis=-1, precise=True), s, reps=reps),
        "  weighted sum (GEMM)": timed_ms(lambda s, v: s @ v, s, v, reps=reps),
        "  softmax in NumPy (vectorised exp)": timed_ms(numpy_softmax, mx.array(s), reps=reps),
        "add on the scores": timed_ms(lambda s: s + 1.0, s, reps=reps),
        "exp on the scores": timed_ms(mx.exp, s, reps=reps),
        "exp on the scores, two CPU streams": timed_ms(
            lambda a, b: [mx.exp(a, stream=streams[0]), mx.exp(b, stream=streams[1])], *halves, reps=reps
        ),
        "power(2, x) on the scores": timed_ms(lambda s: mx.power(2.0, s), s, reps=reps),
        "softmax as powers of two, written out": timed_ms(softmax_pow2, s, reps=reps),
        "softmax, query rows halved on two CPU streams": timed_ms(softmax_two_streams, s, reps=reps),
    }
    elements = s.size
    result = {
        "shape": {"new": new, "context": args.context, "heads": heads, "kv_heads": kv_heads, "head_dim": dim},
        "layers": args.layers,
        "score_elements": elements,
        "ms_per_layer": rows,
        "max_abs_diff_written_out_vs_fast": max_diff,
        "max_abs_diff_softmax_pow2": pow2_diff,
        "max_abs_diff_numpy_softmax_vs_fast": numpy_diff,
        "exp_ns_per_element": rows["exp on the scores"] * 1e6 / elements,
        "add_ns_per_element": rows["add on the scores"] * 1e6 / elements,
    }
    lines = [
        f"# One layer's attention on the CPU: {new} new tokens over {args.context} cached, {heads} heads "
        f"({kv_heads} KV), {dim} dims, float32",
        "",
        f"{elements:,} scores per layer; the written-out attention matches the fast one to {max_diff:.1e}, "
        f"the softmax as powers of two MLX's to {pow2_diff:.1e}, the server's (NumPy's softmax, blocks) to "
        f"{numpy_diff:.1e}.",
        "",
        f"| part | ms per layer | x {args.layers} layers, s |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {ms:.1f} | {ms * args.layers / 1000:.2f} |" for name, ms in rows.items()]
    lines += [
        "",
        f"exp: {result['exp_ns_per_element']:.1f} ns per element, add: {result['add_ns_per_element']:.2f} ns "
        f"({result['exp_ns_per_element'] / result['add_ns_per_element']:.0f}x).",
    ]
    write_report(result, Path(args.out), lines)


if __name__ == "__main__":
    main()
