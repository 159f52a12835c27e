"""Hostile and unlucky clients on the wire (issue 17, items 5, 7, 10-13): slow uploads never take the
in-flight slots (408 after server.body_read_timeout_s), a client gone mid-upload is a 499, pins that
cannot be saved change nothing (507), numbers Python cannot read and lone surrogates are 4xx, and a
chunked flush body is read. The tiny random model, in process: TestClient, or uvicorn in a thread where
the test needs real sockets."""

from __future__ import annotations

import errno
import json
import logging
import re
import select
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import free_port
from mlx_lm.utils import load
from starlette.testclient import TestClient
from test_server_e2e import wait_until

import mlx_kvserve.kv.pins as pins_module
from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.errors import InsufficientStorageError
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

BS = 16
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(3 * BS + 5)]  # 3 full blocks and a tail, as token ids
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HUGE = "9" * 5000  # past int()'s 4300-digit limit
BODY_TIMEOUT_S = 3.0
SLOTS = 2  # server.max_concurrent of the live server


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    model, tokenizer = load(str(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return LoadedModel("tiny", tiny_model_dir, model, tokenizer, config, 2048)


def make_engine(loaded: LoadedModel, root: Path, **server) -> Engine:
    overrides = {"cache": {"block_size": BS}, "ssd": {"cache_dir": str(root / "kv"), "async_writes": False}}
    config = load_config(overrides=overrides | {"server": server})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_KVSERVE_HOME", str(root / "home"))
        return Engine(loaded, config)


@pytest.fixture(scope="module")
def engine(loaded, tmp_path_factory) -> Engine:
    return make_engine(loaded, tmp_path_factory.mktemp("wire"))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        yield client


def post_raw(client, path: str, text: str) -> httpx.Response:
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


# --- item 10: numbers Python cannot turn into the field's type ------------------------------------------

ALL_POSTS = [CHAT, TEXT, "/v1/cache/pin", "/v1/cache/unpin", "/v1/cache/flush", "/v1/cache/prune"]


@pytest.mark.parametrize("path", ALL_POSTS)
def test_an_integer_of_5000_digits_is_a_400_everywhere(client, path):
    reply = post_raw(client, path, f'{{"max_tokens": {HUGE}, "ssd": {HUGE}}}')
    assert reply.status_code == 400, reply.text
    assert "too many digits" in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", ALL_POSTS)
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_not_json(client, path, constant):
    reply = post_raw(client, path, f'{{"temperature": {constant}, "ssd": {constant}}}')
    assert reply.status_code == 400 and constant.lstrip("-") in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [str(10**400), "-" + str(10**400), "1e999", "-1e999"])
def test_floats_beyond_range_are_a_422_naming_the_field(client, path, field, value):
    valid = json.dumps({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    body = valid[:-1] + f', "{field}": {value}}}'  # a number json.dumps cannot write
    reply = post_raw(client, path, body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "extra, status, param",
    [
        # max_tokens 10**400 is lowered to the context's room: test_api_agent_clients.py
        ({"seed": 10**400}, 422, "seed"),
        ({"seed": -(10**400)}, 422, "seed"),
        ({"n": 10**400}, 422, "n"),
        ({"max_tokens": True}, 422, "max_tokens"),  # booleans are not numbers
        ({"temperature": False}, 422, "temperature"),
        ({"n": True}, 422, "n"),
        ({"seed": 1.5}, 422, "seed"),
        ({"logit_bias": {"1": 10**400}}, 422, "logit_bias"),
        ({"echo": 10**400}, 400, "echo"),  # fields not served are named
        ({"top_k": 10**400}, 422, "top_k"),
    ],
)
def test_numeric_fields_of_completions(client, extra, status, param):
    reply = post_raw(client, TEXT, json.dumps({"prompt": "hello there", "max_tokens": 2} | extra))
    assert reply.status_code == status, reply.text
    if param:
        assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("prompt", [[10**400], [-(10**400)], [2**63], [True]])
def test_token_ids_beyond_any_vocabulary_are_a_422(client, prompt):
    reply = post_raw(client, TEXT, json.dumps({"prompt": prompt, "max_tokens": 2}))
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/cache/pin", {"block_hashes": [10**400]}),
        ("/v1/cache/unpin", {"prompt": 10**400}),
        ("/v1/cache/pin", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1}),
        ("/v1/cache/flush", {"ssd": 10**400}),
        ("/v1/cache/flush", {"ssd": 1}),
    ],
)
def test_numbers_in_cache_routes_are_a_422(client, path, body):
    assert post_raw(client, path, json.dumps(body)).status_code == 422


# --- issue 23, bug 1: top_k beyond the vocabulary ----------------------------------------------------------


def test_top_k_above_the_vocabulary_is_a_422_naming_the_bound(client, loaded):
    vocab = loaded.config["vocab_size"]
    user = [{"role": "user", "content": "hello there"}]
    bodies = [
        (TEXT, {"prompt": "hello there", "max_tokens": 3, "temperature": 0.8}),
        (CHAT, {"messages": user, "max_tokens": 3, "temperature": 0.8}),
        ("/v1/messages", {"model": "tiny", "messages": user, "max_tokens": 3, "temperature": 0.8}),
    ]
    for path, body in bodies:
        reply = client.post(path, json=body | {"top_k": vocab + 1})
        assert reply.status_code == (400 if path == "/v1/messages" else 422), reply.text  # Anthropic: all 400s
        assert f"{vocab} (the model's vocabulary size)" in reply.json()["error"]["message"]
    for top_k in (vocab, 0):  # the whole vocabulary keeps every token; sampling goes on working after it
        for path, body in bodies:
            reply = client.post(path, json=body | {"top_k": top_k})
            assert reply.status_code == 200, reply.text


# --- item 11: lone surrogates ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/cache/pin", "/v1/cache/unpin", CHAT, TEXT])
@pytest.mark.parametrize("form", ["prompt", "messages", "parts"])
def test_lone_surrogates_are_a_400_naming_the_field(client, path, form):
    text = "pin me " * 8 + "\ud800 and more"
    content = [{"type": "text", "text": "a "}, {"type": "text", "text": text}] if form == "parts" else text
    body = {"prompt": text} if form == "prompt" else {"messages": [{"role": "user", "content": content}]}
    if (path == CHAT and form == "prompt") or (path == TEXT and form != "prompt"):
        pytest.skip("the chat endpoint takes messages, the completion endpoint a prompt")
    reply = post_raw(client, path, json.dumps(body))  # ensure_ascii: the surrogate travels as "\\ud800"
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "lone surrogate" in error["message"] and "\\ud800" in error["message"]
    assert error["param"] == ("prompt" if form == "prompt" else "messages[0].content")


# --- item 7: pins that cannot be saved ------------------------------------------------------------------


def pin_counts(client) -> dict[str, int]:
    reply = client.get("/v1/cache/pins")
    assert reply.status_code == 200
    return {p["block_hash"]: p["pin_count"] for p in reply.json()["pins"]}


@pytest.fixture
def unwritable_pins(engine, tmp_path, monkeypatch):
    """The pins file's folder is a regular file: every write fails with ENOTDIR (even for root)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    pins = engine.prefix_cache.manager.pins
    monkeypatch.setattr(pins, "path", blocker / "pins.json")
    return pins.path


@pytest.mark.parametrize("form", ["block_hashes", "prompt"])
def test_pin_that_cannot_be_saved_is_a_507_and_changes_nothing(client, engine, unwritable_pins, form):
    manager = engine.prefix_cache.manager
    hashes = [h.hex() for h in manager.hasher.hash_blocks(PROMPT)]
    engine.prefill(PROMPT)  # returns once the blocks are registered (a response comes just before)
    before = pin_counts(client)
    body = {"block_hashes": hashes[-1:]} if form == "block_hashes" else {"prompt": "pin this text " * 6}
    reply = client.post("/v1/cache/pin", json=body)
    assert reply.status_code == 507, reply.text
    error = reply.json()["error"]
    assert str(unwritable_pins) in error["message"] and "Not a directory" in error["message"]
    assert error["code"] == "pins_not_saved" and error["type"] == "server_error"
    assert pin_counts(client) == before
    manager.check_integrity()


def test_unpin_that_cannot_be_saved_is_a_507_and_keeps_the_pin(client, engine, monkeypatch):
    manager = engine.prefix_cache.manager
    hashes = [h.hex() for h in manager.hasher.hash_blocks(PROMPT)]
    engine.prefill(PROMPT)
    assert client.post("/v1/cache/pin", json={"block_hashes": hashes[-1:]}).status_code == 200
    pinned = pin_counts(client)
    assert all(pinned.get(h, 0) >= 1 for h in hashes)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(pins_module, "open_private", full_disk)
        reply = client.post("/v1/cache/unpin", json={"block_hashes": hashes[-1:]})
    assert reply.status_code == 507 and "No space left on device" in reply.json()["error"]["message"]
    assert pin_counts(client) == pinned
    assert client.post("/v1/cache/unpin", json={"block_hashes": hashes[-1:]}).json() == {"unpinned_count": 1}


def test_a_multi_block_pin_is_one_write_all_or_nothing(client, engine, monkeypatch):  # client: the worker runs
    manager = engine.prefix_cache.manager
    other = [t + 1 for t in PROMPT]
    for tokens in (PROMPT, other):
        engine.prefill(tokens)
    targets = [manager.hasher.hash_blocks(PROMPT)[-1], manager.hasher.hash_blocks(other)[-1]]
    before = dict(manager.pins.items())
    writes = []

    def second_write_fails(path, mode="wb"):  # a disk that fills up after one write
        writes.append(path)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode)

    monkeypatch.setattr(pins_module, "open_private", second_write_fails)
    assert manager.pin(targets) == targets and len(writes) == 1  # both chains in one write
    after = dict(manager.pins.items())
    assert all(after.get(h, 0) == before.get(h, 0) + 1 for h in targets)
    with pytest.raises(InsufficientStorageError):
        manager.unpin(targets)  # the second write fails: neither chain is unpinned
    assert dict(manager.pins.items()) == after


def test_failing_ssd_block_writes_do_not_fail_a_pin(client, engine, monkeypatch):
    """The pin writes its chain to the SSD (synchronously here): a full disk there is logged, not a 500."""
    store = engine.prefix_cache.ssd_tier.store

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_temp", full_disk)
    fresh = [(t * 7) % 250 + 3 for t in PROMPT]  # blocks that reach RAM while the SSD refuses them
    engine.prefill(fresh)
    last = engine.prefix_cache.manager.hasher.hash_blocks(fresh)[-1]
    assert not store.contains(last)
    reply = client.post("/v1/cache/pin", json={"block_hashes": [last.hex()]})
    assert reply.status_code == 200 and reply.json()["pinned_count"] == 1, reply.text
    assert client.post("/v1/cache/unpin", json={"block_hashes": [last.hex()]}).status_code == 200


# --- a live server on real sockets: items 5, 12, 13 -----------------------------------------------------


class LiveServer:
    """uvicorn serving the app in a thread of this process, on a free port."""

    def __init__(self, app):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, port=self.port, log_config=None, access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        found = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def live(loaded, tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    engine = make_engine(loaded, root, max_queue=1, max_concurrent=SLOTS, body_read_timeout_s=BODY_TIMEOUT_S)
    with LiveServer(create_app(engine, ApiKeys("", ""))) as server:
        yield server


def idle_upload(server: LiveServer, path: str = TEXT, declared: int = 100, sent: bytes = b"{") -> socket.socket:
    """A connection that sends its headers and `sent`, promising `declared` body bytes."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    sock.sendall(head.encode() + sent)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    received = []
    while chunk := sock.recv(65536):  # the server closes the connection after its answer
        received.append(chunk)
    return b"".join(received)


def test_slowloris_never_takes_the_slots(live):
    assert httpx.post(live.base_url + TEXT, json={"prompt": "warm up", "max_tokens": 2}, timeout=60).status_code == 200
    idle = [idle_upload(live) for _ in range(SLOTS * 3)]  # more idle uploads than slots
    try:
        time.sleep(0.3)  # their headers and first byte are in
        assert live.metric("mlx_kvserve_requests_in_flight") == 0
        started = time.monotonic()
        reply = httpx.post(live.base_url + TEXT, json={"prompt": "served", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200, reply.text  # not 429
        assert time.monotonic() - started < BODY_TIMEOUT_S
        assert select.select(idle, [], [], 0)[0] == []  # served while every idle upload still waits
        for sock in idle:
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"body_timeout"' in answer and b"connection: close" in answer.lower()
        assert time.monotonic() - started >= BODY_TIMEOUT_S - 0.5
    finally:
        for sock in idle:
            sock.close()
    assert live.metric("mlx_kvserve_requests_total", endpoint=TEXT, status="408") == len(idle)
    assert live.metric("mlx_kvserve_request_timeouts_total", kind="body") == len(idle)


@pytest.mark.parametrize("path", [TEXT, "/v1/cache/pin"])
def test_a_client_gone_mid_upload_is_a_499_without_traceback(live, path, caplog):
    caplog.set_level(logging.INFO)
    before = live.metric("mlx_kvserve_requests_total", endpoint=path, status="499")
    idle_upload(live, path, declared=1000, sent=b'{"prompt": "half').close()
    deadline = time.monotonic() + 10
    while live.metric("mlx_kvserve_requests_total", endpoint=path, status="499") == before:
        assert time.monotonic() < deadline, "the disconnect was never recorded"
        time.sleep(0.05)
    assert live.metric("mlx_kvserve_requests_total", endpoint=path, status="500") == 0
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("status=499" in r.getMessage() and "error=client_closed" in r.getMessage() for r in caplog.records)


def test_a_chunked_flush_body_is_read(live):
    assert httpx.post(live.base_url + TEXT, json={"prompt": PROMPT, "max_tokens": 2}, timeout=60).status_code == 200

    def ssd_blocks() -> int:
        return httpx.get(live.base_url + "/v1/cache/stats", timeout=10).json()["ssd_blocks"]

    assert wait_until(lambda: ssd_blocks() > 0, 10)  # blocks are registered just after the response

    def chunks():
        yield b'{"ssd"'
        yield b": true}"

    reply = httpx.post(live.base_url + "/v1/cache/flush", content=chunks(), timeout=30)
    assert reply.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in reply.request.headers
    assert reply.status_code == 200 and reply.json()["ssd_dropped"] > 0, reply.text
    assert ssd_blocks() == 0
    empty = httpx.post(live.base_url + "/v1/cache/flush", timeout=30)  # no body at all: {} as before
    assert empty.status_code == 200 and "ssd_dropped" not in empty.json()


def test_a_content_length_of_thousands_of_digits_is_not_a_crash():
    """The gate's early size check must not call int() on a 5,000-digit header (ValueError)."""
    from mlx_kvserve.server.gate import _declared_length

    huge = {"headers": [(b"content-length", b"9" * 5000)]}
    assert _declared_length(huge) is None  # left to the streamed size, which the limit bounds
    assert _declared_length({"headers": [(b"content-length", b"1234")]}) == 1234


def request_log_line(caplog, marker: str, unless: str = "\0") -> str:
    """The request log line that contains `marker` and not `unless` (waits for it: the server logs when
    the request ends). A line of an earlier test's request can still arrive here: say which is this one's."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if marker in r.getMessage() and unless not in r.getMessage()]
        if lines:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError(f"no request log line with {marker!r}")


def test_a_client_gone_mid_answer_is_logged_as_a_499_with_its_tokens(live, caplog):
    """A non-streamed request whose client leaves while it generates: status 499, error=client_closed,
    and the tokens generated before the server saw the client leave."""
    caplog.set_level(logging.INFO)
    # The tiny model's greedy answer ends after ~560 tokens, ~0.6 s here: the client leaves after 0.1 s,
    # well before that (at 0.5 s the answer was sometimes complete before the server saw it leave).
    body = {"prompt": "left before the answer", "max_tokens": 1900, "temperature": 0.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.base_url + TEXT, json=body, timeout=httpx.Timeout(30, read=0.1))
    line = request_log_line(caplog, "status=499", unless="prompt_tokens=0 ")  # not a request refused unread
    assert "error=client_closed" in line and f"endpoint={TEXT}" in line
    assert int(line.split("completion_tokens=")[1].split()[0]) > 0


def test_a_stream_the_client_cuts_logs_the_tokens_it_sent(live, caplog):
    caplog.set_level(logging.INFO)
    body = {"prompt": "cut the stream", "max_tokens": 1900, "temperature": 0.0, "stream": True}
    pieces = 0
    with httpx.stream("POST", live.base_url + TEXT, json=body, timeout=30) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                pieces += 1
            if pieces == 5:
                break
    line = request_log_line(caplog, "stream=true")
    assert int(line.split("completion_tokens=")[1].split()[0]) >= 5, line
