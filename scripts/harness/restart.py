"""In-process engines on an SSD cache folder, restarted and timed to the first token (no HTTP), and the
report tables of the two benches that run them: bench_restart_hit.py and bench_write_interference.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path


def ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of a one-token greedy request."""
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

    events: list = []
    req = GenerationRequest("bench", list(prompt), SamplingParams(max_tokens=1, temperature=0.0), events.append)
    start = time.perf_counter()
    engine.generator.run(req)
    elapsed = time.perf_counter() - start
    done = events[-1]
    assert isinstance(done, Finished), events
    return elapsed, done.usage.cached_tokens


def served_ttft(engine, tokens: list[int]) -> tuple[float, int]:
    """(the engine's TTFT seconds, cached tokens) of a one-token greedy request."""
    from mlx_kvserve.engine.request import SamplingParams

    done = served(engine, tokens, SamplingParams(max_tokens=1, temperature=0.0))
    return done.first_token_s, done.usage.cached_tokens


def served_token_times(engine, tokens: list[int], max_tokens: int) -> tuple[list[float], int]:
    """(seconds from submission to each generated token, cached tokens) of a greedy request (with its
    logprob, so that every token is an event of its own, text or not)."""
    from mlx_kvserve.engine.request import SamplingParams, TextDelta

    times: list[float] = []

    def on_event(event) -> None:
        if isinstance(event, TextDelta):
            times.extend([time.perf_counter()] * event.num_tokens)

    start = time.perf_counter()
    done = served(engine, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True), on_event)
    return [t - start for t in times], done.usage.cached_tokens


def served(engine, tokens: list[int], params, on_event=None):
    """A request sent through the engine's worker as the server sends it (Engine.submit), waited for:
    its Finished event; raises the request's error. `on_event` sees each event as it comes."""
    from mlx_kvserve.engine.request import Failed, Finished, GenerationRequest

    done = threading.Event()
    events: list = []

    def record(event) -> None:
        if on_event is not None:
            on_event(event)
        events.append(event)

    engine.submit(GenerationRequest(f"bench-{time.monotonic_ns()}", tokens, params, record, on_done=done.set))
    if not done.wait(3600):
        raise TimeoutError("request did not finish")
    last = events[-1]
    if isinstance(last, Failed):
        raise last.error
    assert isinstance(last, Finished), last
    return last


def make_engine(loaded, folder: Path, block_size: int, split: bool):
    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine

    from .kvstack import server_attention

    overrides = {
        "cache": {"block_size": block_size},
        "ssd": {"cache_dir": str(folder), "compute_while_loading": split, "write_hold_s": 0.0},
    }
    config = load_config(overrides=overrides)
    server_attention(loaded.model, config)  # as `mlx-kvserve run` installs it (the engine does not)
    return Engine(loaded, config)


def restart_report_lines(r: dict) -> list[str]:
    lines = [
        f"# First request after a restart: SmolLM2-135M f32, {r['prompt_tokens']} prompt tokens, "
        f"{r['kv_mib']:.0f} MiB of KV on disk, median of {r['reps']}",
        "",
        f"Cold TTFT {r['cold_s']:.2f} s; RAM hit {r['ram_hit_s']:.3f} s. "
        f"Cached tokens after restart: {r['cached_tokens']}; blocks computed by the split: "
        f"{r['split_computed_blocks']}.",
        "",
        "| after restart | TTFT s | cold / TTFT | floor s (raw read + RAM hit) | TTFT / floor |",
        "|---|---|---|---|---|",
    ]
    for mode in ("page_cache", "cold"):
        if f"read_{mode}" not in r:
            continue
        floor = r[f"floor_{mode}"]
        for kind in ("read", "split"):
            t = r[f"{kind}_{mode}"]
            lines.append(
                f"| {kind}, files {mode.replace('_', ' ')} | {t:.3f} | {r['cold_s'] / t:.1f}x | {floor:.3f} | "
                f"{t / floor:.2f}x |"
            )
    return lines


def interference_report_lines(r: dict) -> list[str]:
    lines = [
        f"# A cold prefill while the SSD writer writes the previous request's blocks (median of {r['reps']})",
        "",
        "| write_hold_s | queued at B's start MiB | B busy TTFT s | C idle TTFT s | slowdown | writer MiB/s | "
        "raw write MiB/s | writer / raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for hold, h in r["holds"].items():
        lines.append(
            f"| {hold} | {h['queued_mib']:.0f} | {h['busy_s']:.2f} | {h['idle_s']:.2f} | "
            f"{(h['slowdown'] - 1) * 100:+.0f}% | {h['writer_mib_s']:.0f} | {h['raw_write_mib_s']:.0f} | "
            f"{h['writer_vs_raw']:.2f}x |"
        )
    return lines
