"""The router against backends that misbehave: a layout or events it cannot use, a backend that takes a
request and never answers. A bad backend is dropped (and says why in /health), never the router; the
event follower survives anything a backend sends and follows again once the backend is sound."""

import asyncio
import json
import logging
import time

import httpx
import pytest
from routerharness import ByteTokenizer, FakeBackend, ServerThread, chat_tokens, wait_for

from mlx_kvserve.config import RouterConfig
from mlx_kvserve.router import follower
from mlx_kvserve.router.app import create_router_app
from mlx_kvserve.router.reports import BadReportError, parse_layout, parse_message

SYSTEM = "You are a careful assistant. " * 4


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@pytest.fixture
def started():
    """start(FakeBackend or router app) -> it, stopped after the test (routers first)."""
    routers, backends = [], []

    def start(thing):
        if isinstance(thing, FakeBackend):
            backends.append(thing.start())
        else:
            routers.append(thing)
        return thing

    yield start
    for s in routers + backends:
        s.stop()


def router_over(started, backends, **config) -> ServerThread:
    config = RouterConfig(backends=[b.url for b in backends], **{"health_interval_s": 0.2, **config})
    return started(ServerThread(create_router_app(config, tokenizer=ByteTokenizer(), client_key="", backend_key="")))


def row(router, backend) -> dict:
    rows = httpx.get(router.url + "/health", timeout=5).json()["backends"]
    return next(r for r in rows if r["url"] == backend.url)


def chat(router, user: str, stream: bool = False, timeout: float = 10.0) -> httpx.Response:
    body = {"messages": messages(user), "max_tokens": 4, "stream": stream}
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=timeout)


GOOD_LAYOUT = {"model": "m", "enabled": True, "namespace": "ab" * 32, "block_size": 16, "epoch": "e", "last_seq": 0}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -1}, "block_size"),
        ({"block_size": 2**40}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": "16"}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"namespace": "ab" * 31}, "namespace"),
        ({"namespace": 5}, "namespace"),
        ({"epoch": None}, "epoch"),
        ({"enabled": "yes"}, "enabled"),
        ({"model": ["m"]}, "model"),
    ],
)
def test_layout_checks_each_field(change, field):
    assert parse_layout(json.dumps(GOOD_LAYOUT).encode()).block_size == 16
    with pytest.raises(BadReportError, match=f"layout.{field}"):
        parse_layout(json.dumps({**GOOD_LAYOUT, **change}).encode())
    assert parse_layout(b'{"enabled": false, "model": "m"}').namespace is None  # no cache there: fine


@pytest.mark.parametrize(
    "name, data",
    [
        ("snapshot", {"epoch": "e", "seq": 0}),
        ("snapshot", {"epoch": "e", "seq": 0, "hashes": "ab" * 32}),
        ("events", {"epoch": "e", "seq": 1, "events": [["kept", "ab" * 32]]}),
        ("events", {"epoch": "e", "seq": 1, "events": [["stored"]]}),
        ("events", {"epoch": 1, "seq": 1, "events": []}),
    ],
)
def test_event_messages_are_checked(name, data):
    with pytest.raises(BadReportError, match=name):
        parse_message(name, json.dumps(data))
    assert parse_message("unknown", "not json") is None  # a newer server's message: ignored


def test_an_endless_event_is_a_bad_report_not_unbounded_memory(monkeypatch):
    monkeypatch.setattr(follower, "MAX_MESSAGE_BYTES", 1000)

    async def chunks():
        yield b"event: snapshot\ndata: "
        for _ in range(100):
            yield b"a" * 100

    async def read():
        return [event async for event in follower.iter_sse(chunks())]

    with pytest.raises(BadReportError, match="over 1000 bytes"):
        asyncio.run(read())


@pytest.mark.parametrize("block_size", [0, -1])
def test_backend_reporting_a_bad_block_size_is_dropped_not_the_router(started, monkeypatch, block_size):
    monkeypatch.setattr(follower, "RETRY_S", 0.05)
    bad, good = started(FakeBackend("bad")), started(FakeBackend("good"))
    bad.layout_body = {**bad.real_layout(), "block_size": block_size}
    router = router_over(started, [bad, good], policy="round_robin")  # would send every other request to `bad`
    wait_for(lambda: bad.num_layout_requests >= 1 and row(router, good)["events"]["following"], what="followers")
    time.sleep(0.2)  # the bad layout has been read
    replies = [chat(router, f"q{i}") for i in range(4)]
    assert [r.status_code for r in replies] == [200] * 4
    assert {r.headers["x-kvserve-backend"] for r in replies} == {good.url}
    bad_row = row(router, bad)
    assert not bad_row["up"] and "block_size" in bad_row["error"] and not bad_row["events"]["following"]
    assert httpx.get(router.url + "/health").json()["status"] == "degraded"
    bad.layout_body = None  # the backend reports a sound layout again: back in rotation
    wait_for(lambda: row(router, bad)["up"] and row(router, bad)["events"]["following"], timeout=10, what="return")
    assert row(router, bad)["error"] is None
    assert {chat(router, f"r{i}").headers["x-kvserve-backend"] for i in range(2)} == {bad.url, good.url}


@pytest.mark.parametrize(
    "body",
    [b"[]", b'{"enabled": true, "namespace": "zz", "block_size": 4, "epoch": "e"}', b"[" * 50_000],
    ids=["list", "bad-namespace", "deep"],
)
def test_follower_survives_a_malformed_layout_logs_it_once_and_follows_again(started, monkeypatch, caplog, body):
    monkeypatch.setattr(follower, "RETRY_S", 0.02)
    monkeypatch.setattr(follower, "MAX_RETRY_S", 0.05, raising=False)
    caplog.set_level(logging.INFO, logger="mlx_kvserve.router")
    a = started(FakeBackend("a"))
    a.layout_body = body
    router = router_over(started, [a])
    wait_for(lambda: a.num_layout_requests >= 4, what="the follower to retry")
    assert not row(router, a)["up"] and "layout" in row(router, a)["error"]
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and a.url in r.getMessage()]
    assert len(warned) == 1 and "layout" in warned[0].getMessage()  # once, with the reason
    a.layout_body = None
    wait_for(lambda: row(router, a)["events"]["following"] and row(router, a)["up"], what="following again")
    n = a.store(chat_tokens(messages("after")))
    wait_for(lambda: row(router, a)["cached_blocks"] == n, what="the blocks after the recovery")


def test_follower_survives_malformed_events_and_follows_again(started, monkeypatch):
    monkeypatch.setattr(follower, "RETRY_S", 0.02)
    a = started(FakeBackend("a"))
    a.event_streams = [
        'event: events\ndata: {"epoch": "e", "seq": 1e999, "events": []}\n\n',  # int(inf) raised OverflowError
        'event: snapshot\ndata: {"epoch": "e", "seq": 0, "hashes": ["zz"]}\n\n',
        'event: events\ndata: {"epoch": "e", "seq": 3, "events": [["stored", 5]]}\n\n',
        "event: events\ndata: " + "[" * 100_000 + "\n\n",  # RecursionError
        'event: snapshot\ndata: {"epoch": "e", "seq": -1, "hashes": []}\n\n',
    ]
    router = router_over(started, [a])
    wait_for(lambda: not a.event_streams, what="the follower to read every bad stream")
    wait_for(lambda: row(router, a)["events"]["following"] and row(router, a)["up"], what="following again")
    n = a.store(chat_tokens(messages("after")))
    wait_for(lambda: row(router, a)["cached_blocks"] == n, what="the blocks after the recovery")
    assert chat(router, "x").status_code == 200


def test_a_backend_that_takes_requests_and_hangs_times_out_and_gets_no_more(started):
    hang, good = started(FakeBackend("hang")), started(FakeBackend("good"))
    hang.mode = "hang"  # /health still answers: only the timeout can tell
    router = router_over(started, [hang, good], policy="round_robin", health_interval_s=60.0, first_byte_timeout_s=0.5)
    wait_for(lambda: all(row(router, b)["events"]["following"] for b in (hang, good)), what="followers")
    start = time.monotonic()
    r = chat(router, "first", stream=True)  # round robin starts with `hang`: after 0.5 s, the next one
    assert r.status_code == 200 and r.headers["x-kvserve-backend"] == good.url
    assert time.monotonic() - start < 3
    hang_row = row(router, hang)
    assert not hang_row["up"] and "first_byte_timeout_s" in hang_row["error"]
    replies = [chat(router, f"q{i}", stream=i % 2 == 0) for i in range(4)]
    assert {r.headers["x-kvserve-backend"] for r in replies} == {good.url}
    assert all(time.monotonic() - start < 6 for _ in replies)


@pytest.mark.parametrize("stream", [False, True])
def test_only_a_hanging_backend_gives_a_504_within_the_timeout(started, stream):
    hang = started(FakeBackend("hang"))
    hang.mode = "hang"
    router = router_over(started, [hang], health_interval_s=60.0, first_byte_timeout_s=0.5, read_timeout_s=1.0)
    wait_for(lambda: row(router, hang)["events"]["following"], what="the follower")
    start = time.monotonic()
    r = chat(router, "x", stream=stream)
    assert r.status_code == 504 and time.monotonic() - start < 4
    assert ("first_byte_timeout_s" if stream else "read_timeout_s") in r.json()["error"]["message"]
    assert not row(router, hang)["up"]
