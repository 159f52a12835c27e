"""End to end: the router in front of three real servers of the tiny model on loopback.

A session's later turns reach the backend that holds its blocks (cached tokens as the backend reports them),
load spreads when that backend is overloaded, and a backend killed mid-stream gives its client a clear error
while the router keeps serving with the others.
"""

import json
import threading

import httpx
import pytest
from conftest import ServerProcess
from routerharness import ServerThread, wait_for

from mlx_kvserve.config import RouterConfig
from mlx_kvserve.router.app import create_router_app

pytestmark = pytest.mark.slow
SYSTEM = "You are the support assistant of a small bakery. Answer briefly and politely. " * 8  # ~10 blocks


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    backends = [ServerProcess(tiny_model_dir, tmp_path_factory.mktemp(f"home{i}")) for i in range(3)]
    router = None
    try:
        for b in backends:
            b.wait_ready()
        config = RouterConfig(backends=[b.base_url for b in backends], policy="unified", health_interval_s=0.5)
        router = ServerThread(create_router_app(config))  # the tokenizer comes from the model the backends report
        wait_for(lambda: health(router)["tokenizer"] == "loaded", timeout=60, what="the router's tokenizer")
        yield router, backends
    finally:
        if router is not None:
            router.stop()
        for b in backends:
            b.stop()


def health(router) -> dict:
    return httpx.get(router.url + "/health", timeout=5).json()


def cached_blocks(router, url: str) -> int:
    return next(row["cached_blocks"] for row in health(router)["backends"] if row["url"] == url)


def chat(router, msgs, session, max_tokens=8) -> httpx.Response:
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=60)


def test_later_turns_reach_the_backend_holding_the_session(cluster):
    router, _ = cluster
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell rye bread?"}]
    first = chat(router, history, "alice")
    home = first.headers["x-kvserve-backend"]
    wait_for(lambda: cached_blocks(router, home) >= 10, what="the first turn's block events")
    for question in ("And on Sundays?", "How much is it?"):
        history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
        history += [{"role": "user", "content": question}]
        reply = chat(router, history, "alice")
        assert reply.headers["x-kvserve-backend"] == home
        usage = reply.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 10 * 64  # the backend's own count
        first = reply
        need = usage["prompt_tokens"] // 64
        wait_for(lambda n=need: cached_blocks(router, home) >= n, what="this turn's blocks")
    metrics = httpx.get(router.url + "/metrics").text
    assert f'mlx_kvserve_router_decisions_total{{backend="{home}",policy="unified",reason="affinity"}} 2.0' in metrics
    row = next(row for row in health(router)["backends"] if row["url"] == home)
    assert row["claims"] == {"contradicted": 0, "ignored_s": 0}  # a real server's replies bear its claims out


def test_load_spreads_when_the_sessions_backend_is_overloaded(cluster):
    router, _ = cluster
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a long story."}]
    home = chat(router, msgs, "bob").headers["x-kvserve-backend"]
    wait_for(lambda: cached_blocks(router, home) >= 10, what="bob's blocks")
    seen: list[str] = []

    def ask() -> None:
        seen.append(chat(router, msgs, "bob", max_tokens=300).headers["x-kvserve-backend"])

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen.count(home) >= 2 and len(set(seen)) >= 2  # sticks while it can, then spreads
    assert "affinity_overloaded" in httpx.get(router.url + "/metrics").text


def test_backend_killed_mid_stream_gives_a_clear_error_and_the_rest_serve(cluster):
    router, backends = cluster
    # Greedy, the tiny model writes ~780 tokens for this prompt before its end token (~0.6 s, far longer than
    # reading 3 events); a sampled or shorter reply could end before the kill and make no error to see.
    body = {"messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 1500, "stream": True}
    body["temperature"] = 0
    events: list[str] = []
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
        victim = next(b for b in backends if b.base_url == r.headers["x-kvserve-backend"])
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    victim.proc.kill()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "backend_failed"
    row = next(row for row in health(router)["backends"] if row["url"] == victim.base_url)
    assert not row["up"]
    for i in range(3):
        reply = chat(router, [{"role": "user", "content": f"still there {i}?"}], f"carol{i}")
        assert reply.status_code == 200 and reply.headers["x-kvserve-backend"] != victim.base_url
