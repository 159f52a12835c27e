"""The router app against fake backends on loopback: cache-aware decisions from the backends' block events,
streaming passthrough, client disconnects, failover, auth, /health and /metrics."""

import json
import threading
import time

import httpx
import pytest
from routerharness import BS, ByteTokenizer, FakeBackend, ServerThread, chat_tokens, free_port, wait_for

from mlx_kvserve.config import RouterConfig
from mlx_kvserve.router.app import create_router_app

SYSTEM = "You are a careful assistant. " * 4


def messages(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.fixture
def backends():
    started = [FakeBackend(name).start() for name in ("a", "b", "c")]
    yield started
    for b in started:
        b.stop()


@pytest.fixture
def router_for():
    servers = []

    def start(backends, client_key="", backend_key="", **config):
        urls = [b if isinstance(b, str) else b.url for b in backends]
        app = create_router_app(
            RouterConfig(backends=urls, **{"health_interval_s": 0.2, **config}),
            tokenizer=ByteTokenizer(),
            client_key=client_key,
            backend_key=backend_key,
        )
        servers.append(ServerThread(app))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def health(router) -> dict:
    return httpx.get(router.url + "/health").json()


def blocks_known(router, n_by_url: dict[str, int]) -> bool:
    rows = {r["url"]: r["cached_blocks"] for r in health(router)["backends"]}
    return all(rows[url] == n for url, n in n_by_url.items())


def chat(router, msgs, session=None, timeout=10.0, headers=None) -> httpx.Response:
    headers = {**({"x-session-id": session} if session else {}), **(headers or {})}
    body = {"messages": msgs, "max_tokens": 4}
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def test_request_goes_to_the_backend_that_reported_its_blocks(backends, router_for):
    router = router_for(backends, policy="unified")  # lmetric scores every idle backend 0: the first would win
    a, b, c = backends
    n = c.store(chat_tokens(messages("hello there")))  # only c holds the prompt's prefix
    wait_for(lambda: blocks_known(router, {c.url: n}), what="c's stored events")
    r = chat(router, messages("hello there"))
    assert r.status_code == 200 and r.headers["x-kvserve-backend"] == c.url
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n * BS
    # evicted on c (a flush): the router hears of it and the estimate is gone
    c.manager.flush()
    wait_for(lambda: blocks_known(router, {c.url: 0}), what="c's removed events")
    metrics = httpx.get(router.url + "/metrics").text
    assert f'mlx_kvserve_router_estimated_cached_tokens_total{{backend="{c.url}"}} {float(n * BS)}' in metrics
    assert f'mlx_kvserve_router_reported_cached_tokens_total{{backend="{c.url}"}} {float(n * BS)}' in metrics
    assert (
        'mlx_kvserve_router_decisions_total{backend="' + c.url + '",policy="unified",reason="lowest_score"}' in metrics
    )


def test_session_turns_stay_with_their_backend_under_unified(backends, router_for):
    router = router_for(backends, policy="unified")
    first = chat(router, messages("turn one"), session="s1")
    home = first.headers["x-kvserve-backend"]
    owner = next(b for b in backends if b.url == home)
    total = len(owner.hasher.hash_blocks(chat_tokens(messages("turn one"))))
    wait_for(lambda: blocks_known(router, {home: total}), what="the first turn's blocks")
    for turn in ("turn two", "turn three"):
        r = chat(router, messages(turn), session="s1")
        assert r.headers["x-kvserve-backend"] == home
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert health(router)["backends"][0]["requests"] == 0  # load counters went back to zero


def test_cold_requests_spread_round_robin_under_unified(backends, router_for):
    router = router_for(backends, policy="unified")
    # prompts that differ from their first block on: no backend holds any of another's
    seen = [chat(router, messages(f"cold {i}", system=f"{i} distinct")).headers["x-kvserve-backend"] for i in range(3)]
    assert sorted(seen) == sorted(b.url for b in backends)


def test_load_spreads_when_the_affinity_backend_is_overloaded(backends, router_for):
    router = router_for(backends, policy="unified", overload_factor=2.0)
    a = backends[0]
    n = a.store(chat_tokens(messages("busy")))
    wait_for(lambda: blocks_known(router, {a.url: n}), what="a's blocks")
    a.mode, a.delay_s = "slow", 1.0
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(chat(router, messages("busy"), session="hot").headers["x-kvserve-backend"])
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
        time.sleep(0.3)  # one at a time, so each decision sees the ones before it in flight (each takes 2 s)
    for t in threads:
        t.join()
    # a holds the cache: the first three stick (3 <= 2 x max(avg, 1) until it passes), then it is overloaded
    assert results.count(a.url) == 3 and len(set(results)) == 2
    assert 'reason="affinity_overloaded"' in httpx.get(router.url + "/metrics").text


def test_stream_is_passed_through_as_it_arrives(backends, router_for):
    router = router_for(backends[:1])
    backends[0].mode, backends[0].delay_s, backends[0].num_chunks = "slow", 1.0, 3
    start, arrivals = time.monotonic(), []
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"messages": messages("x"), "stream": True}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 5  # role chunk, three tokens, usage
    assert arrivals[1] < 0.9 and arrivals[-1] > 1.9  # the first token came before the backend was done


def test_client_disconnect_cancels_the_upstream_stream(backends, router_for):
    router = router_for(backends[:1])
    b = backends[0]
    b.mode, b.delay_s, b.num_chunks = "slow", 0.2, 50
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"messages": messages("x"), "stream": True}
    ) as r:
        for line in r.iter_lines():
            if "a1" in line:
                break
    wait_for(lambda: b.closed == 1, what="the backend to see its client leave")
    wait_for(lambda: health(router)["backends"][0]["requests"] == 0, what="the router's load to drop")


def test_client_disconnect_cancels_a_whole_reply_being_computed(backends, router_for):
    router = router_for(backends[:1])
    b = backends[0]
    b.mode, b.delay_s = "slow", 1.5
    with pytest.raises(httpx.ReadTimeout):
        chat(router, messages("x"), timeout=0.3)
    wait_for(lambda: b.closed == 1, what="the backend to see the router leave")
    assert b.finished == 0


def test_unreachable_backend_fails_over_and_is_taken_out(backends, router_for):
    dead = f"http://127.0.0.1:{free_port()}"
    router = router_for([dead, backends[0].url], policy="round_robin")
    results = [chat(router, messages(f"q{i}")) for i in range(3)]
    assert all(r.status_code == 200 and r.headers["x-kvserve-backend"] == backends[0].url for r in results)
    row = health(router)["backends"][0]
    assert not row["up"] and row["error"]
    assert health(router)["status"] == "degraded"


def test_no_backend_gives_a_clear_503_and_a_dead_one_502(router_for):
    a = FakeBackend("a").start()
    router = router_for([a], health_interval_s=60.0)  # polled once, at the start: up
    wait_for(lambda: health(router)["backends"][0]["events"]["following"], what="the router to follow a")
    a.stop()  # gone before the next poll: the request finds out
    r = chat(router, messages("x"))
    assert r.status_code == 502 and "no backend answered" in r.json()["error"]["message"]
    r = chat(router, messages("x"))  # now out of rotation: none is up
    assert r.status_code == 503 and r.json()["error"]["message"] == "no backend is up"
    assert httpx.get(router.url + "/health").status_code == 503


def test_backend_dying_mid_stream_ends_that_stream_clearly_and_others_keep_serving(backends, router_for):
    router = router_for(backends[:2], policy="round_robin", health_interval_s=60.0)  # polled at the start only
    a, b = backends[:2]
    wait_for(lambda: all(row["events"]["following"] for row in health(router)["backends"]), what="followers")
    a.mode = "die"
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"messages": messages("x"), "stream": True}
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.headers["x-kvserve-backend"] == a.url
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "backend_failed" and events[-1] == "data: [DONE]"
    assert chat(router, messages("y")).headers["x-kvserve-backend"] == b.url
    assert not health(router)["backends"][0]["up"]


def test_failed_backend_is_probed_back_in(backends, router_for):
    router = router_for(backends[:2])
    backends[0].mode = "down"
    wait_for(lambda: not health(router)["backends"][0]["up"], what="a to be taken out")
    assert {chat(router, messages(f"q{i}")).headers["x-kvserve-backend"] for i in range(3)} == {backends[1].url}
    backends[0].mode = "ok"
    wait_for(lambda: health(router)["backends"][0]["up"], what="a to be probed back in")


def test_anthropic_stream_dying_gets_an_anthropic_error_event(backends, router_for):
    router = router_for(backends[:1], health_interval_s=60.0)
    wait_for(lambda: health(router)["backends"][0]["events"]["following"], what="the follower")
    backends[0].mode = "die"
    body = {"model": "x", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", router.url + "/v1/messages", json=body) as r:
        text = "".join(r.iter_text())
    assert "event: error" in text and '"type": "api_error"' in text


def test_busy_backend_is_skipped_for_the_next(backends, router_for):
    router = router_for(backends[:2], policy="round_robin")
    backends[0].mode = "busy"
    r = chat(router, messages("x"))
    assert r.status_code == 200 and r.headers["x-kvserve-backend"] == backends[1].url
    backends[1].mode = "busy"
    assert chat(router, messages("x")).status_code == 503  # the last one's answer is passed on


def test_router_key_and_backend_key(backends, router_for):
    router = router_for(backends[:1], client_key="router-key", backend_key="backend-key")
    assert chat(router, messages("x")).status_code == 401
    assert httpx.get(router.url + "/health").status_code == 200
    r = chat(router, messages("x"), headers={"authorization": "Bearer router-key"})
    assert r.status_code == 200
    path, headers, _ = backends[0].seen[-1]
    assert headers["authorization"] == "Bearer backend-key"  # the client's key never reaches a backend
    r = httpx.post(
        router.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"}
    )  # Anthropic clients' header, Anthropic's error shape
    assert r.status_code == 401 and r.json()["type"] == "error"


def test_session_from_user_field_and_anthropic_metadata(backends, router_for):
    router = router_for(backends, policy="sticky")
    body = {"messages": messages("x"), "user": "u1"}
    homes = {httpx.post(router.url + "/v1/chat/completions", json=body).headers["x-kvserve-backend"] for _ in range(3)}
    assert len(homes) == 1
    anth = {
        "model": "x",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "u2"},
    }
    homes = {httpx.post(router.url + "/v1/messages", json=anth).headers["x-kvserve-backend"] for _ in range(3)}
    assert len(homes) == 1


def test_a_prompt_cache_key_keeps_its_backend_on_responses_and_chat(backends, router_for):
    router = router_for(backends, policy="sticky")
    a = backends[0]
    keyed = {"model": "x", "input": "first turn", "prompt_cache_key": "conv-1"}
    first = httpx.post(router.url + "/v1/responses", json=keyed)
    assert first.status_code == 200 and first.headers["x-kvserve-backend"] == a.url  # all idle: the first
    a.mode, a.delay_s = "slow", 1.0
    busy = threading.Thread(target=lambda: chat(router, messages("no key")))  # no session: a, idle, takes it
    busy.start()
    time.sleep(0.3)
    try:  # a is now the most loaded: only the key's affinity brings the next turns there
        again = httpx.post(router.url + "/v1/responses", json=keyed | {"input": "second turn"}, timeout=10)
        other = httpx.post(router.url + "/v1/responses", json=keyed | {"prompt_cache_key": "conv-2"})
        body = {"messages": messages("third turn"), "prompt_cache_key": "conv-1"}
        chatted = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    finally:
        busy.join()
    assert again.headers["x-kvserve-backend"] == chatted.headers["x-kvserve-backend"] == a.url
    assert other.headers["x-kvserve-backend"] != a.url


def test_stored_responses_are_found_on_the_backend_that_keeps_them(backends, router_for):
    router = router_for(backends, policy="round_robin")
    ids = [httpx.post(router.url + "/v1/responses", json={"model": "x", "input": "hi"}).json()["id"] for _ in "ab"]
    holder = backends[1]
    assert ids[1] in holder.kept  # the second went to b; a GET, a follow-up and a DELETE find it there
    got = httpx.get(router.url + f"/v1/responses/{ids[1]}")
    assert got.status_code == 200 and got.headers["x-kvserve-backend"] == holder.url
    follow = {"model": "x", "input": "and then?", "previous_response_id": ids[1]}
    r = httpx.post(router.url + "/v1/responses", json=follow)
    assert r.status_code == 200 and r.headers["x-kvserve-backend"] == holder.url
    assert httpx.delete(router.url + f"/v1/responses/{ids[1]}").json()["deleted"] is True
    assert httpx.get(router.url + f"/v1/responses/{ids[1]}").status_code == 404  # kept nowhere now


def test_only_a_200_finds_a_stored_response(backends, router_for):
    a, b, _ = backends
    router = router_for([a, b], policy="round_robin")
    for _ in "ab":  # round robin: one kept on each
        httpx.post(router.url + "/v1/responses", json={"model": "x", "input": "hi"})
    (rid,) = b.kept
    a.lookup_status = 500  # broken, and asked first for a lookup (the least loaded, first seen)
    for _ in range(2):
        got = httpx.get(router.url + f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.headers["x-kvserve-backend"] == b.url, got.text
    assert httpx.delete(router.url + f"/v1/responses/{rid}").json()["deleted"] is True


def test_a_backend_whose_replies_contradict_its_claims_loses_them(backends, router_for):
    router = router_for(backends, policy="unified")
    a, b, c = backends
    n = c.store(chat_tokens(messages("what I claim")))
    wait_for(lambda: blocks_known(router, {c.url: n}), what="c's stored events")
    c.report_cached = 0  # it claims the blocks, and every reply says nothing was cached
    for _ in range(3):
        r = chat(router, messages("what I claim"))
        assert r.status_code == 200 and r.headers["x-kvserve-backend"] == c.url
    rows = {row["url"]: row for row in health(router)["backends"]}
    assert rows[c.url]["claims"]["contradicted"] == 3 and rows[c.url]["claims"]["ignored_s"] > 50
    assert rows[a.url]["claims"] == {"contradicted": 0, "ignored_s": 0}
    chat(router, messages("what I claim"))  # the claim no longer counts: no hit estimated anywhere
    metrics = httpx.get(router.url + "/metrics").text
    assert f'mlx_kvserve_router_estimated_cached_tokens_total{{backend="{c.url}"}} {float(3 * n * BS)}' in metrics
    assert f'mlx_kvserve_router_backend_claim_contradictions{{backend="{c.url}"}} 3.0' in metrics


def test_body_limits_and_unreadable_bodies(backends, router_for):
    router = router_for(backends[:1], max_body_bytes=2048)
    r = httpx.post(router.url + "/v1/chat/completions", content=b"x" * 4096)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(router.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400  # the backend's answer, passed on
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "a"


def test_backend_restart_resyncs_blocks_from_a_snapshot(router_for):
    a = FakeBackend("a").start()
    port = a.server.port
    router = router_for([a])
    try:
        n = a.store(chat_tokens(messages("before restart")))
        wait_for(lambda: blocks_known(router, {a.url: n}), what="the first process's blocks")
        a.stop()
        a2 = FakeBackend("a").start(port)  # a new process: new epoch, other blocks
        a = a2
        m = a2.store(chat_tokens(messages("after", system="other")))
        wait_for(lambda: blocks_known(router, {a2.url: m}), timeout=15, what="the snapshot of the new process")
        assert (
            'mlx_kvserve_router_block_resyncs_total{backend="' + a2.url + '"} 2.0'
            in httpx.get(router.url + "/metrics").text
        )
    finally:
        a.stop()


def test_a_trailing_slash_is_a_404_not_a_redirect(backends, router_for):
    router = router_for(backends)
    headers = {"Host": "localhost:9"}  # a Host the guard lets through (an unknown name gets 421 first)
    reply = httpx.post(f"{router.url}/v1/chat/completions/", json={}, headers=headers, timeout=10)
    assert reply.status_code == 404 and "location" not in reply.headers
