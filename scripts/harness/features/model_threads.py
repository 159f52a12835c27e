"""Why two models in one process are not fair to each other (issue 27), with no mlx-kvserve code: two
mlx-lm BatchGenerators, a small model's and a large model's, each on its own thread as the engines'
workers are. Side by side in one run, the small model's time to its first token (a cold 256-token
prompt, medians): alone; while the large model prefills 1024-token prompts on another thread of the
same process; and while it prefills them in another process.

MLX's scheduler caps the tasks in flight per process, not per stream: `eval_impl` (mlx/transforms.cpp,
MAX_ACTIVE_TASKS = 10; on the CPU a task is 10 dispatched operations, mlx/backend/cpu/encoder.h) waits for
any task to complete before scheduling more while over the cap. With a large model prefilling on another
thread the cap is reached by its graph, so the small model's operations enter their own stream's queue
behind completions of the large model's tasks (matrix products over a whole prefill chunk). Another
process has its own scheduler (gdb showed the small model's thread waiting in pthread_cond_wait inside
mlx::core::eval_impl; the --gdb flag that printed it retired with 77ef6db).

    .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/features.py model-threads [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from harness.synthetic import llama_config, random_llama

LARGE = {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816, "num_attention_heads": 16}
LARGE |= {"num_key_value_heads": 4, "max_position_embeddings": 8192}
STEP = 512  # the prefill chunk (the engine's on the CPU)


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 101) % 250 + 3 for i in range(n)]


def first_token(gen: BatchGenerator, tokens: list[int]) -> float:
    """Seconds from insert to the first generated token; the rest of the reply is drained."""
    start = time.perf_counter()
    gen.insert([tokens], max_tokens=[2])
    took = None
    while True:
        prompts, generated = gen.next()
        if took is None and generated:
            took = time.perf_counter() - start
        if not prompts and not generated and took is not None:
            return took


def model(which: str):
    if which == "small":
        m = random_llama(llama_config("tiny", max_position_embeddings=32768), seed=0, scale=4.0)
    else:
        m = random_llama(llama_config("tiny", **LARGE), seed=1)
    mx.eval(m.parameters())
    return m


def large_loop(stop) -> None:
    """Prefill cold 1024-token prompts with the large model until `stop` is set."""
    gen, i = BatchGenerator(model("large"), prefill_step_size=STEP), 0
    while not stop.is_set():
        first_token(gen, prompt(1024, 1000 + i))
        i += 1


def small_ttfts(gen: BatchGenerator, repeats: int, seed: int) -> list[float]:
    out = []
    for i in range(repeats):
        out.append(first_token(gen, prompt(256, seed + i)))
        time.sleep(0.05)
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> None:
    out: dict = {"load_avg_start": os.getloadavg(), "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}
    small = BatchGenerator(model("small"), prefill_step_size=STEP)
    small_ttfts(small, 2, 0)  # warm
    out["alone_s"] = statistics.median(small_ttfts(small, args.repeats, 100))

    stop = threading.Event()
    big = threading.Thread(target=large_loop, args=(stop,))
    big.start()
    time.sleep(1.0)
    out["beside_thread_s"] = statistics.median(small_ttfts(small, args.repeats, 200))
    stop.set()
    big.join()

    ctx = multiprocessing.get_context("spawn")
    stop_p = ctx.Event()
    proc = ctx.Process(target=large_loop, args=(stop_p,))
    proc.start()
    time.sleep(4.0)  # the child imports MLX and builds its model first
    out["beside_process_s"] = statistics.median(small_ttfts(small, args.repeats, 400))
    stop_p.set()
    proc.join()

    for key in ("beside_thread_s", "beside_process_s"):
        out[key.replace("_s", "_ratio")] = round(out[key] / out["alone_s"], 2)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=2, default=lambda v: round(v, 4)))
