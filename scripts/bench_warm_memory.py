"""A prefix assembled from its blocks on Linux: fresh pages or reused ones (glibc's malloc tunables,
mlx_kvserve/cpu/warm_memory.py), one CPU stream or the server's two (kv/concat.py).

Two child processes, the same work, one with the tunables the server sets at its start and one with
glibc's defaults (`MLX_KVSERVE_WARM_MEMORY=0`), OpenBLAS preloaded in both:
- `assembly`: a prefix assembled from its blocks as the engine does it (per layer, the keys' and the
  values' blocks concatenated with room after them, on a thread of its own as the engine's worker),
  `--reps` times, each assembly freed before the next, in turn on one stream (mx.concatenate) and as
  the server joins them (kv/concat.py join_pair: the values on a second CPU stream); the `kv-heavy`
  shape by default (32 layers, 4 KV heads of 128 dims, float32: 128 KiB per token) at `--tokens`.
  Per rep: seconds and, on one stream, the page faults the process took (`ru_minflt`: a fault per
  fresh 4 KiB page) and the floor beside it: one read of the same bytes.
- with `--join`: scripts/bench_join.py on the same shape (a new question on a cached ~4.4k-token
  prefix through the engine, in process), the TTFT medians of both processes side by side.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_warm_memory.py [--tokens 4446]
           [--reps 5] [--join]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import ROOT
from harness.reports import write_report

from mlx_kvserve.cpu import blas, warm_memory

BLOCK = 128
SETTINGS = ("tunables (the server's)", "glibc defaults")


def child_env(tunables: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", warm_memory.ENV_SWITCH)}
    if not tunables:
        env[warm_memory.ENV_SWITCH] = "0"
    env = blas.preload_env(env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "scripts"), env.get("PYTHONPATH", "")])
    return env


def assembly(tokens: int, layers: int, kv_heads: int, dims: int, reps: int) -> dict:
    """In this process: per rep (seconds, page faults) of assembling, and the read floor's seconds."""
    import resource
    import threading
    import time

    import mlx.core as mx

    from mlx_kvserve.kv.concat import join_pair

    out: dict = {"seconds": [], "faults": [], "read_s": [], "two_streams_s": []}

    def one_stream(keys: list, values: list) -> tuple:
        return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)

    def run() -> None:
        count = -(-tokens // BLOCK)
        blocks = [
            [
                (mx.random.normal((1, kv_heads, BLOCK, dims)), mx.random.normal((1, kv_heads, BLOCK, dims)))
                for _ in range(count)
            ]
            for _ in range(layers)
        ]
        mx.eval(blocks)
        room = mx.zeros((1, kv_heads, 256, dims))
        for rep in range(2 * reps):
            join = one_stream if rep % 2 == 0 else join_pair
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            cache = [join([k for k, _ in layer] + [room], [v for _, v in layer] + [room]) for layer in blocks]
            mx.eval(cache)
            if join is join_pair:
                out["two_streams_s"].append(time.perf_counter() - start)
                del cache
                continue
            out["seconds"].append(time.perf_counter() - start)
            out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            start = time.perf_counter()
            mx.eval([k.sum() + v.sum() for k, v in cache])
            out["read_s"].append(time.perf_counter() - start)
            del cache
        out["bytes"] = layers * 2 * count * BLOCK * kv_heads * dims * 4

    thread = threading.Thread(target=run)  # MLX's streams are per thread: all of it on this one
    thread.start()
    thread.join()
    return out


def run_child(tunables: bool, argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *argv],
        env=child_env(tunables),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def join_medians(tunables: bool, out: Path) -> dict:
    script = ROOT / "scripts" / "bench_join.py"
    args = ["--synthetic", "kv-heavy", "--words", "800", "--reps", "4", "--out", str(out)]
    args += ["--variants", "join in place,mlx-lm one cache"]
    # Not check=True: MLX may abort tearing down the engine's worker thread at exit, after the report.
    done = subprocess.run([sys.executable, str(script), *args], env=child_env(tunables), capture_output=True, text=True)
    if not (out / "results.json").exists():
        raise RuntimeError(f"bench_join.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads((out / "results.json").read_text())["medians"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4446)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dims", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--join", action="store_true", help="also bench_join.py's big-KV question in both settings")
    p.add_argument("--out", default=str(ROOT / "results" / "warm_memory"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = ["--tokens", str(args.tokens), "--layers", str(args.layers), "--kv-heads", str(args.kv_heads)]
    shape += ["--dims", str(args.dims), "--reps", str(args.reps)]
    if args.child:
        print(json.dumps(assembly(args.tokens, args.layers, args.kv_heads, args.dims, args.reps)), flush=True)
        os._exit(0)  # MLX aborts tearing down a finished thread's stream at interpreter exit
    results = {name: run_child(name == SETTINGS[0], shape) for name in SETTINGS}
    gib = results[SETTINGS[0]]["bytes"] / 2**30
    lines = [
        "# Assembling a prefix into fresh or reused pages (glibc's malloc tunables)",
        "",
        f"{args.tokens} tokens, {args.layers} layers x {args.kv_heads} KV heads x {args.dims} dims, float32: "
        f"{gib:.2f} GiB per assembly, {args.reps} reps each, the first rep's pages fresh in both",
        "",
        "| malloc | one stream: assembly s, reps 2.. median | all reps | page faults per rep (2..) | "
        "two streams (the server's) s, median | all reps | read floor s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        later = r["seconds"][1:] or r["seconds"]
        lines.append(
            f"| {name} | {statistics.median(later):.3f} | {', '.join(f'{s:.3f}' for s in r['seconds'])} | "
            f"{statistics.median(r['faults'][1:] or r['faults']):.0f} | {statistics.median(r['two_streams_s']):.3f} | "
            f"{', '.join(f'{s:.3f}' for s in r['two_streams_s'])} | {statistics.median(r['read_s']):.3f} |"
        )
    if args.join:
        with tempfile.TemporaryDirectory() as tmp:
            results["join"] = {
                name: join_medians(name == SETTINGS[0], Path(tmp) / str(i)) for i, name in enumerate(SETTINGS)
            }
        lines += ["", "bench_join.py --synthetic kv-heavy --words 800 --reps 4 (medians, s):", ""]
        lines += ["| malloc | join in place (the engine) | mlx-lm one cache |", "|---|---|---|"]
        for name, medians in results["join"].items():
            lines.append(f"| {name} | {medians['join in place']:.3f} | {medians['mlx-lm one cache']:.3f} |")
    write_report(results, Path(args.out), lines)


if __name__ == "__main__":
    main()
