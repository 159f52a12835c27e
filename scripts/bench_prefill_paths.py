"""Where a cold prefill's time goes: plain mlx-lm vs mlx-lm's BatchGenerator vs the engine.

On the GPU machine the engine's cold TTFT was 2.1-2.8x plain `stream_generate`'s (8B shape, 2k-16k
tokens), while on this CPU they are level (compute-bound). This script times one cold prompt of
each length through, in one process and one run:

- `stream_generate` with mlx-lm's default prefill step (2048) and with the engine's (512);
- mlx-lm's `BatchGenerator` alone (one request, the same two steps): the batch machinery's cost;
- the product's `Engine` with the SSD tier off and on, at both steps (the SSD tier's writer is
  idle when the request starts: a cold request right after another cold one is timed apart as
  `engine ssd busy`, the writer then still writing the previous prompt's blocks).

Usage:
  GPU:  python3 scripts/bench_prefill_paths.py --out results/prefill_paths
  CPU:  .venv/bin/python scripts/bench_prefill_paths.py --shape tiny --bits 0 --dtype float32 --lengths 512
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import median

import harness  # noqa: F401  (puts the repository on sys.path)
import numpy as np
from harness.kvstack import server_attention
from harness.restart import served_ttft


def build(args: argparse.Namespace, folder: Path):
    import mlx.core as mx
    from harness.synthetic import llama_config, random_llama, write_model_folder
    from mlx_lm.utils import load_tokenizer

    from mlx_kvserve.models.loader import LoadedModel, context_length

    overrides = {"quantization": {"group_size": 64, "bits": args.bits}} if args.bits else {}
    config = llama_config(args.shape, **overrides)
    longest = max(int(n) for n in args.lengths.split(","))
    config["max_position_embeddings"] = max(config["max_position_embeddings"], longest + 64)
    model = random_llama(config, dtype=getattr(mx, args.dtype))
    write_model_folder(folder, config)
    return LoadedModel(f"random-{args.shape}", folder, model, load_tokenizer(folder), config, context_length(config))


def plain(loaded, tokens: list[int], step: int) -> float:
    from mlx_lm.generate import stream_generate

    start = time.perf_counter()
    for _ in stream_generate(loaded.model, loaded.tokenizer, tokens, max_tokens=1, prefill_step_size=step):
        break
    return time.perf_counter() - start


def batch_generator(loaded, tokens: list[int], step: int) -> float:
    from mlx_lm.generate import BatchGenerator

    start = time.perf_counter()
    gen = BatchGenerator(loaded.model, prefill_step_size=step, completion_batch_size=8, prefill_batch_size=8)
    gen.insert([tokens], max_tokens=[1])
    try:
        while True:
            out = gen.next()
            responses = out[1] if isinstance(out, tuple) else out
            if responses:
                return time.perf_counter() - start
    finally:
        gen.close()


class EngineRun:
    def __init__(self, loaded, work: Path, step: int, ssd: bool):
        from mlx_kvserve.config import load_config
        from mlx_kvserve.engine.engine import Engine

        config = load_config(
            overrides={
                "cache": {"ram_max_bytes": "64GiB" if loaded.config["hidden_size"] >= 1024 else "1GiB"},
                "ssd": {"cache_dir": str(work), "enabled": ssd},
                "generation": {"prefill_step_size": step},
            }
        )
        server_attention(loaded.model, config)  # as `mlx-kvserve run` installs it (cpu/attention.py)
        self.engine = Engine(loaded, config)
        self.engine.start()

    def ttft(self, tokens: list[int]) -> float:
        return served_ttft(self.engine, tokens)[0]

    def stop(self) -> None:
        self.engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="results/prefill_paths")
    args = p.parse_args()
    import mlx.core as mx

    work = Path(tempfile.mkdtemp(prefix="kvserve-paths-"))
    loaded = build(args, work / "model")
    rng = np.random.default_rng(0)
    vocab = loaded.config["vocab_size"]

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, size=n).tolist()

    results: dict = {"device": str(mx.default_device()), "lengths": {}}
    for length in (int(n) for n in args.lengths.split(",")):
        rows: dict[str, list[float]] = {}

        def time_it(name: str, fn, rows=rows, length=length) -> None:
            fn(ids(length))  # warm-up: kernels for this shape
            rows[name] = [fn(ids(length)) for _ in range(args.reps)]
            print(f"{length} {name}: {[round(x, 3) for x in rows[name]]}", flush=True)

        for step in (2048, 512):
            time_it(f"stream_generate step {step}", lambda t, s=step: plain(loaded, t, s))
            time_it(f"BatchGenerator step {step}", lambda t, s=step: batch_generator(loaded, t, s))
        for step in (2048, 512):
            for ssd in (False, True):
                run = EngineRun(loaded, work / f"kv-{step}-{ssd}-{length}", step, ssd)
                try:
                    time_it(f"engine ssd {'on' if ssd else 'off'} step {step}", run.ttft)
                    if ssd:  # the writer busy with the previous prompts' blocks
                        busy = [run.ttft(ids(length)) for _ in range(args.reps)]
                        rows[f"engine ssd busy step {step}"] = busy
                        print(f"{length} engine ssd busy step {step}: {[round(x, 3) for x in busy]}", flush=True)
                finally:
                    run.stop()
        results["lengths"][length] = {k: median(v) for k, v in rows.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    base = {n: r["stream_generate step 2048"] for n, r in results["lengths"].items()}
    print("| path | " + " | ".join(f"{n} tokens s (x plain)" for n in results["lengths"]) + " |")
    print("|---|" + "---|" * len(results["lengths"]))
    for name in next(iter(results["lengths"].values())):
        cells = [f"{r[name]:.3f} ({r[name] / base[n]:.2f}x)" for n, r in results["lengths"].items()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
