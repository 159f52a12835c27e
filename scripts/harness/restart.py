"""Requests sent to an in-process engine (no HTTP) and timed to the first token: what the engine scenarios
(bench_engine.py) time after a restart on the same cache folder, and on RAM hits."""

from __future__ import annotations

import threading
import time


def ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of a one-token greedy request."""
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

    events: list = []
    req = GenerationRequest("bench", list(prompt), SamplingParams(max_tokens=1, temperature=0.0), events.append)
    start = time.perf_counter()
    engine.scheduler.run(req)
    elapsed = time.perf_counter() - start
    done = events[-1]
    assert isinstance(done, Finished), events
    return elapsed, done.usage.cached_tokens


def served_ttft(engine, tokens: list[int]) -> tuple[float, int]:
    """(the engine's TTFT seconds, cached tokens) of a one-token greedy request."""
    from mlx_kvserve.engine.request import SamplingParams

    done = served(engine, tokens, SamplingParams(max_tokens=1, temperature=0.0))
    return done.first_token_s, done.usage.cached_tokens


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
