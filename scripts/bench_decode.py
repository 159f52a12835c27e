"""One client's decode speed: the engine's batch (one request in it) next to mlx-lm's own generation loop
(`stream_generate`, what `mlx_lm.generate` runs), side by side in one process, alternated rep by rep.

The same greedy request each time (a ~`words`-word prompt, `max_tokens` tokens, speculation off so
both run one forward pass per token); decode tokens/s = (tokens after the first) / (time from the
first token to the last). The two must produce the same tokens. Issue 26's target: the engine within
3% of mlx-lm (a ratio of at least 0.97).

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_decode.py [--reps 5] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from harness import ROOT, default_model_dir
from harness.kvstack import server_attention
from harness.prompts import system_prompt
from harness.reports import write_report


def engine_decode(engine, prompt: list[int], max_tokens: int) -> tuple[tuple[int, ...], float]:
    """(tokens, decode tokens/s) of one greedy request through the engine's worker."""
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta

    marks: list[tuple[float, int]] = []
    events: list = []
    done = threading.Event()

    def emit(event) -> None:
        if isinstance(event, TextDelta) and event.num_tokens:
            marks.append((time.perf_counter(), event.num_tokens))
        events.append(event)

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.submit(GenerationRequest(f"decode-{time.monotonic_ns()}", prompt, params, emit, on_done=done.set))
    done.wait(3600)
    assert isinstance(events[-1], Finished), events[-1]
    tokens = sum(n for _, n in marks[1:])
    return events[-1].token_ids, tokens / (marks[-1][0] - marks[0][0])


def mlx_lm_decode(model, tokenizer, prompt: list[int], max_tokens: int) -> tuple[tuple[int, ...], float]:
    """(tokens, decode tokens/s) of mlx-lm's stream_generate, greedy, on a fresh cache."""
    from mlx_lm.generate import stream_generate

    marks: list[float] = []
    tokens: list[int] = []
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        marks.append(time.perf_counter())
        tokens.append(response.token)
    return tuple(tokens), (len(marks) - 1) / (marks[-1] - marks[0])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the default model)")
    p.add_argument("--words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "results" / "decode"))
    args = p.parse_args(argv)

    import os

    import mlx.core as mx

    from mlx_kvserve.config import default_home, load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import load_model

    model_dir = Path(args.model) if args.model else default_model_dir()
    loaded = load_model(str(model_dir), default_home() / "models", "float32")
    tok = loaded.tokenizer
    # A prompt the model does not end early: a long text to continue, no chat template.
    prompt = tok.encode(system_prompt("decode", target_words=args.words) + "\n\nThe next section explains")
    config = load_config(overrides={"ssd": {"enabled": False}, "speculative": {"mode": "off"}})
    server_attention(loaded.model, config)  # as `mlx-kvserve run` installs it (cpu/attention.py)
    engine = Engine(loaded, config)
    engine.start()
    load_start = os.getloadavg()
    rates: dict[str, list[float]] = {"engine": [], "mlx-lm": []}
    outputs: dict[str, set] = {"engine": set(), "mlx-lm": set()}
    try:
        engine_decode(engine, prompt, 8)  # warm both paths
        mlx_lm_decode(loaded.model, tok, prompt, 8)
        for rep in range(args.reps):
            for name in ("engine", "mlx-lm") if rep % 2 == 0 else ("mlx-lm", "engine"):
                if name == "engine":
                    tokens, rate = engine_decode(engine, prompt, args.max_tokens)
                else:
                    tokens, rate = mlx_lm_decode(loaded.model, tok, prompt, args.max_tokens)
                rates[name].append(rate)
                outputs[name].add(tokens)
                mx.clear_cache()
    finally:
        engine.stop()
    same = outputs["engine"] == outputs["mlx-lm"] and len(outputs["engine"]) == 1
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ratio = medians["engine"] / medians["mlx-lm"]
    lines = [
        "# One client's decode: the engine's batch vs mlx-lm's stream_generate",
        "",
        f"{loaded.name}, prompt {len(prompt)} tokens, {args.max_tokens} tokens greedy, {args.reps} reps alternated, "
        f"medians; mx {mx.__version__} on {mx.default_device()}; load average {load_start[0]:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; same tokens: {same}",
        "",
        "| path | decode tokens/s (median) | all reps |",
        "|---|---|---|",
        *(f"| {k} | {medians[k]:.1f} | {', '.join(f'{r:.1f}' for r in v)} |" for k, v in rates.items()),
        "",
        f"engine / mlx-lm: {ratio:.3f} (target >= 0.97)",
    ]
    results = {"prompt_tokens": len(prompt), "rates": rates, "medians": medians, "ratio": ratio, "same_tokens": same}
    write_report(results, Path(args.out), lines)
    if not same:
        raise SystemExit("the engine and mlx-lm gave different tokens")
    return results


if __name__ == "__main__":
    main()
