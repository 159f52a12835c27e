"""Where the first long prompt after a start spends its time, in-process, with a stack sampler.

On the lent GPU machine our server's first ~7.7k-token prompt after a start took 32-33 s where
`mlx_lm.server` took 2-2.6 s, and every later long prompt took 1.3 s (docs/benchmarks.md "GPU"). This
script replays that order through the product's Engine (no HTTP): a short warm-up request, then
three different long prompts, each answering `--answer` tokens. For each it reports the engine's TTFT,
the time to the last token, and when the request's events reached the caller; a sampler thread
records every 10 ms what each named thread is running (the innermost frames), and the longest gaps
between its own ticks (a thread holding the GIL without releasing it shows up as a gap).

Usage (GPU):  python3 scripts/bench_first_prompt.py --out results/first_prompt
CPU smoke run: python scripts/bench_first_prompt.py --shape tiny --bits 0 --length 512 --out /tmp/fp
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from harness.kvstack import server_attention
from harness.reports import write_report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", help="llama3-8b | tiny (harness/synthetic.py SHAPES)")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--length", type=int, default=7700, help="tokens in each long prompt")
    p.add_argument("--answer", type=int, default=16, help="tokens generated per request")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--speculative", default="auto", help="[speculative] mode (auto | off | prompt_lookup)")
    p.add_argument("--no-ssd", action="store_true", help="run without the SSD tier")
    p.add_argument("--out", default="results/first_prompt")
    return p.parse_args(argv)


class Sampler:
    """Every `interval` s: the innermost frames of each named thread, counted; and the gaps."""

    def __init__(self, interval: float = 0.01, depth: int = 6):
        self.interval, self.depth = interval, depth
        self.counts: dict[str, collections.Counter] = {}
        self.gaps: list[tuple[float, float]] = []  # (gap s, at s since start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        self.counts, self.gaps, self._t0 = {}, [], time.perf_counter()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            if now - last > 5 * self.interval:
                self.gaps.append((now - last, last - self._t0))
            last = now
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "?")
                if name in ("sampler", "MainThread"):
                    continue
                stack = []
                while frame is not None and len(stack) < self.depth:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                self.counts.setdefault(name, collections.Counter())[" < ".join(stack)] += 1

    def report(self, top: int = 8) -> dict:
        return {
            "gaps_s": sorted(((round(g, 3), round(at, 3)) for g, at in self.gaps), reverse=True)[:10],
            "threads": {
                name: [(n * self.interval, stack) for stack, n in c.most_common(top)] for name, c in self.counts.items()
            },
        }


def one_request(engine, tokens: list[int], answer: int) -> dict:
    from mlx_kvserve.engine.request import Failed, Finished, GenerationRequest, SamplingParams

    done = threading.Event()
    arrivals: list[float] = []
    events: list = []

    def on_event(ev) -> None:
        arrivals.append(time.perf_counter())
        events.append(ev)

    start = time.perf_counter()
    params = SamplingParams(max_tokens=answer, temperature=0.0)
    engine.submit(GenerationRequest(f"fp-{time.monotonic_ns()}", tokens, params, on_event, on_done=done.set))
    done.wait(3600)
    end = time.perf_counter()
    last = events[-1]
    if isinstance(last, Failed):
        raise last.error
    assert isinstance(last, Finished), last
    return {
        "engine_ttft_s": round(last.first_token_s, 3),
        "first_event_s": round(arrivals[0] - start, 3),
        "last_event_s": round(arrivals[-1] - start, 3),
        "done_s": round(end - start, 3),
        "cached_tokens": last.usage.cached_tokens,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import mlx.core as mx
    from harness.synthetic import llama_config, random_llama, write_model_folder
    from mlx_lm.utils import load_tokenizer

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import LoadedModel, context_length

    work = Path(tempfile.mkdtemp(prefix="first-prompt-"))
    overrides = {"quantization": {"group_size": 64, "bits": args.bits}} if args.bits else {}
    config = llama_config(args.shape, **overrides)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], args.length + 64)
    model = random_llama(config, dtype=mx.float16 if args.shape != "tiny" else mx.float32)
    write_model_folder(work / "model", config)
    tokenizer = load_tokenizer(work / "model")
    loaded = LoadedModel(f"random-{args.shape}", work / "model", model, tokenizer, config, context_length(config))
    ssd = {"enabled": False} if args.no_ssd else {"cache_dir": str(work / "kv")}
    cfg = load_config(
        overrides={"cache": {"ram_max_bytes": "16GiB"}, "ssd": ssd, "speculative": {"mode": args.speculative}}
    )
    server_attention(loaded.model, cfg)  # as `mlx-kvserve run` installs it (cpu/attention.py)
    engine = Engine(loaded, cfg)
    engine.start()
    rng = np.random.default_rng(0)
    vocab = min(config["vocab_size"], 30000)
    sampler = Sampler()
    sampler.start()
    rows = []
    samples = {}
    try:
        warm = one_request(engine, rng.integers(100, vocab, 64).tolist(), args.answer)
        rows.append({"request": "warm-up, 64 tokens", **warm})
        samples["warm-up"] = sampler.report()
        print(rows[-1], flush=True)
        for i in range(args.prompts):
            sampler.reset()
            row = one_request(engine, rng.integers(100, vocab, args.length).tolist(), args.answer)
            time.sleep(1.0)  # what follows the request (block cut, SSD writes) is sampled too
            rows.append({"request": f"long prompt {i + 1}, {args.length} tokens", **row})
            samples[f"long prompt {i + 1}"] = sampler.report()
            print(rows[-1], flush=True)
    finally:
        sampler.stop()
        engine.stop()
    lines = [
        "# First long prompt after a start (in-process Engine)",
        "",
        f"mlx {mx.__version__}, {mx.default_device()}, shape {args.shape}, {args.bits}-bit weights, "
        f"{args.answer} tokens per answer, speculative {args.speculative}, SSD {'off' if args.no_ssd else 'on'}",
        "",
        "| request | engine TTFT s | first event s | last event s | done s | cached |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['request']} | {r['engine_ttft_s']} | {r['first_event_s']} | {r['last_event_s']} | {r['done_s']} "
            f"| {r['cached_tokens']} |"
            for r in rows
        ),
    ]
    for name, rep in samples.items():
        lines += ["", f"## {name}: longest sampler gaps (s, at s)", "", str(rep["gaps_s"])]
        for thread, stacks in rep["threads"].items():
            lines += ["", f"### thread {thread} (seconds sampled, innermost frames first)", ""]
            lines += [f"- {secs:.2f} s: `{stack}`" for secs, stack in stacks]
    write_report({"rows": rows, "samples": samples}, Path(args.out), lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
