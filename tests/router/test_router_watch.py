"""The router's reply watcher: token events and usage read from a reply as it passes, in time linear in the
reply's size whatever its chunks and events look like."""

import json
import time
import tracemalloc

from mlx_kvserve.router import watch
from mlx_kvserve.router.watch import ReplyWatcher


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


TOKEN = sse({"choices": [{"delta": {"content": "x"}}]})
USAGE = sse({"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}})


def chunks(data: bytes, size: int):
    return (data[i : i + size] for i in range(0, len(data), size))


def feed_all(watcher: ReplyWatcher, parts, budget_s: float = 10.0) -> int:
    """Feed every part; fails as soon as the budget is spent (a quadratic watcher would take minutes)."""
    start, tokens = time.monotonic(), 0
    for part in parts:
        tokens += watcher.feed(part)
        assert time.monotonic() - start < budget_s, f"feeding took over {budget_s}s"
    return tokens


def test_a_30_mb_event_in_small_chunks_is_read_in_linear_time_and_bounded_memory():
    huge = sse({"choices": [{"delta": {"content": "y" * 30_000_000}}]})
    stream = TOKEN * 3 + huge + TOKEN * 2 + USAGE + b"data: [DONE]\n\n"
    watcher = ReplyWatcher(is_stream=True)
    tracemalloc.start()
    try:
        tokens = feed_all(watcher, chunks(stream, 4096), budget_s=20.0)  # the old watcher: 40 s
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the oversized event is skipped, never held whole; everything around it is read
    assert peak_bytes < 2 * watch.MAX_EVENT_BYTES + 1024 * 1024
    assert tokens == 5 and (watcher.prompt_tokens, watcher.cached_tokens) == (7, 4)


def test_many_events_in_one_big_chunk_are_split_in_linear_time(monkeypatch):
    # 5 MB in one chunk: splitting off one event at a time copied the rest each time (13 s). Parsing each
    # event's JSON is linear anyway and is left out here, so the budget measures the splitting alone.
    n = 100_000
    seen: list[int] = []
    monkeypatch.setattr(ReplyWatcher, "_event", lambda self, raw: seen.append(len(raw)))
    feed_all(ReplyWatcher(is_stream=True), [TOKEN * n + USAGE], budget_s=5.0)
    assert seen == [len(TOKEN) - 2] * n + [len(USAGE) - 2]


def test_many_events_are_counted():
    watcher = ReplyWatcher(is_stream=True)
    tokens = feed_all(watcher, [TOKEN * 1000, TOKEN * 1000 + USAGE[:10], USAGE[10:]])
    assert tokens == 2000 and watcher.prompt_tokens == 7


def test_event_boundaries_split_anywhere_across_chunks_including_crlf():
    stream = (TOKEN * 3 + USAGE).replace(b"\n", b"\r\n")
    for size in (1, 2, 3, 7):
        watcher = ReplyWatcher(is_stream=True)
        tokens = feed_all(watcher, chunks(stream, size))
        assert tokens == 3 and watcher.prompt_tokens == 7, size


def test_whole_reply_usage():
    watcher = ReplyWatcher(is_stream=False)
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}})
    for part in chunks(body.encode(), 5):
        assert watcher.feed(part) == 0
    watcher.finish()
    assert (watcher.prompt_tokens, watcher.cached_tokens) == (9, 8)
