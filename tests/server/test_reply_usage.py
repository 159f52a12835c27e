"""The token counts of a reply relayed from a model's own process (server/reply_usage.py): read from
each API's usage shape, JSON or streamed, from the closing usage comment a stream gives when asked,
and never from what is not there."""

import json
import time

from mlx_kvserve.server.metrics import RequestRecord
from mlx_kvserve.server.reply_usage import ReplyUsage, usage_comment


def record() -> RequestRecord:
    return RequestRecord("req-1", "POST", "/v1/chat/completions", time.monotonic())


def counts(r: RequestRecord) -> tuple[int, int, int, bool]:
    return r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.stream


def fed(content_type: str, body: bytes, chunk: int = 7) -> RequestRecord:
    r = record()
    usage = ReplyUsage(r, content_type)
    for i in range(0, len(body), chunk):  # chunk boundaries anywhere, as the network cuts them
        usage.feed(body[i : i + chunk])
    usage.close()
    return r


def sse(*events: dict, comment: bytes = b"") -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + comment + b"data: [DONE]\n\n"


def test_json_replies_of_the_three_apis():
    openai = {"usage": {"prompt_tokens": 120, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 96}}}
    assert counts(fed("application/json", json.dumps(openai).encode())) == (120, 96, 9, False)
    responses = {"usage": {"input_tokens": 50, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 32}}}
    assert counts(fed("application/json", json.dumps(responses).encode())) == (50, 32, 4, False)
    anthropic = {"usage": {"input_tokens": 10, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 6}}
    anthropic["usage"]["output_tokens"] = 3
    assert counts(fed("application/json", json.dumps(anthropic).encode())) == (80, 64, 3, False)


def test_streams_take_their_usage_events_and_the_first_output_event():
    r = fed(
        "text/event-stream",
        sse(
            {"choices": [{"delta": {"role": "assistant"}}]},
            {"choices": [{"delta": {"content": "Hi"}}]},
            {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}},
        ),
    )
    assert counts(r) == (30, 0, 2, True) and r.first_token_s is not None
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 16}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 7}}
    r = fed("text/event-stream", sse(start, {"type": "content_block_delta"}, delta))
    assert counts(r) == (21, 16, 7, True) and r.first_token_s is not None
    done = {"type": "response.completed", "response": {"usage": {"input_tokens": 12, "output_tokens": 5}}}
    assert counts(fed("text/event-stream", sse(done))) == (12, 0, 5, True)


def test_the_closing_usage_comment_counts_a_stream_that_carries_no_usage():
    bare = sse({"choices": [{"delta": {"content": "Hi"}}]})
    assert counts(fed("text/event-stream", bare)) == (0, 0, 0, True)  # nothing made up
    source = record()
    source.prompt_tokens, source.cached_tokens, source.completion_tokens = 400, 384, 12
    r = fed("text/event-stream", sse({"choices": [{"delta": {"content": "Hi"}}]}, comment=usage_comment(source)))
    assert counts(r) == (400, 384, 12, True)


def test_what_cannot_be_read_leaves_the_record_as_it_was():
    assert counts(fed("application/json", b'{"usage": {"prompt_tokens": 3')) == (0, 0, 0, False)
    assert counts(fed("text/plain", b"usage: 5")) == (0, 0, 0, False)
    assert counts(fed("text/event-stream", b"data: {not json}\n\n: keep-alive\n\n")) == (0, 0, 0, True)
    ReplyUsage(None, "application/json").feed(b"{}")  # no record (a request outside the gate): nothing to fill
