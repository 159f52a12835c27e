"""Web pages cannot use a local server (issue 46, "Browser requests"): a request from another page's
origin, or naming the server by a name that is not its own (DNS rebinding), is refused before it runs;
the server's own page (/ui) and clients that are no browsers (no Origin) are served as before; CORS only
for configured origins; no keyless server listens beyond loopback unless told to. The tiny model, in
process; the router against a fake backend; `run` and `router` refusing to start."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from click.testing import CliRunner
from routerharness import ByteTokenizer, FakeBackend, ServerThread
from starlette.datastructures import Headers
from starlette.testclient import TestClient
from test_api_anthropic import _loaded
from test_hardening_wire import make_engine

from mlx_kvserve.cli import cli
from mlx_kvserve.config import ApiKeys, RouterConfig
from mlx_kvserve.errors import ConfigError
from mlx_kvserve.router.app import create_router_app
from mlx_kvserve.server import local_guard
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.local_guard import check_exposure, decide, guard_policy

SERVER = "http://localhost:8000"
EVIL = "http://evil.example"
CHAT = {"messages": [{"role": "user", "content": "hello there, " * 40}], "max_tokens": 2, "temperature": 0}
TEXT_PLAIN = {"content-type": "text/plain"}  # what a form or a no-cors fetch may send without a preflight


@pytest.fixture(autouse=True)
def production_names(monkeypatch):
    """The loopback names production answers (conftest adds TestClient's `testserver` for other tests)."""
    monkeypatch.setattr(local_guard, "LOOPBACK_NAMES", frozenset({"localhost"}))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    loaded = _loaded(tiny_model_dir, "tiny")
    return make_engine(loaded, tmp_path_factory.mktemp("guard"), allowed_origins=["https://app.example"])


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ApiKeys("", "")), base_url=SERVER) as client:
        yield client


def cached_blocks(client) -> int:
    return client.get("/v1/cache/stats").json()["kv_ram_blocks"]


def test_a_page_on_another_origin_runs_nothing(client):
    import json

    before = cached_blocks(client)
    reply = client.post("/v1/chat/completions", content=json.dumps(CHAT), headers={**TEXT_PLAIN, "Origin": EVIL})
    assert reply.status_code == 403, reply.text
    assert reply.json()["error"]["code"] == "origin_not_allowed" and EVIL in reply.json()["error"]["message"]
    assert cached_blocks(client) == before  # the prompt never ran

    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # curl, SDKs: no Origin
    filled = cached_blocks(client)
    assert filled > before
    form = {**TEXT_PLAIN, "Origin": EVIL, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}
    reply = client.post("/v1/cache/flush", content=b"{}", headers=form)
    assert reply.status_code == 403, reply.text
    assert cached_blocks(client) == filled  # not flushed


def test_a_rebinding_name_reads_nothing(client):
    client.post("/v1/chat/completions", json=CHAT)
    reply = client.get("/v1/cache/requests", headers={"Host": "evil.example:8000"})
    assert reply.status_code == 421, reply.text
    assert reply.json()["error"]["code"] == "host_not_allowed" and "requests" not in reply.json()
    assert client.get("/ui", headers={"Host": "evil.example:8000"}).status_code == 421
    assert client.get("/v1/cache/requests").json()["requests"]  # by its own name, it answers


def test_testclient_host_is_not_answered_in_production(engine):
    plain = TestClient(create_app(engine, ApiKeys("", "")))  # Host: testserver; no lifespan (the guard needs none)
    assert plain.get("/v1/models").status_code == 421


def test_with_a_key_any_host_is_answered_and_the_key_decides(engine):
    """A rebinding page cannot send the key, and LAN clients may name the server as they like."""
    keyed = TestClient(create_app(engine, ApiKeys("k-1", "")))  # the engine runs already (module fixture)
    lan = {"Host": "mac-a.local:8000"}
    assert keyed.get("/v1/models", headers=lan).status_code == 401
    assert keyed.get("/v1/models", headers={**lan, "Authorization": "Bearer k-1"}).status_code == 200
    evil = {**lan, "Authorization": "Bearer k-1", "Origin": EVIL}
    assert keyed.get("/v1/models", headers=evil).status_code == 403  # the Origin check stays


def test_the_servers_own_page_is_served(client):
    page = client.get("/ui", headers={"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"})
    assert page.status_code == 200 and "<html" in page.text.lower()
    own = {"Origin": SERVER, "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}
    reply = client.post("/v1/chat/completions", json=CHAT, headers=own)
    assert reply.status_code == 200, reply.text
    assert "access-control-allow-origin" not in reply.headers  # same origin: no CORS needed
    for host in ("127.0.0.1:8000", "[::1]:8000"):
        reply = client.get("/v1/models", headers={"Host": host, "Origin": f"http://{host}"})
        assert reply.status_code == 200, (host, reply.text)
    other_port = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})  # a dev server's page
    assert other_port.status_code == 403


def test_cross_site_loads_without_origin_are_refused_navigations_are_not(client):
    script = client.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})
    assert script.status_code == 403 and script.json()["error"]["code"] == "cross_site_request"
    link = client.get("/ui", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
    assert link.status_code == 200


def test_a_configured_origin_gets_cors(client):
    origin = "https://app.example"
    ask = {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    preflight = client.options("/v1/chat/completions", headers=ask)
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "content-type"
    reply = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin
    refused = client.options("/v1/chat/completions", headers={**ask, "Origin": EVIL})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers


def test_decide_is_pure_policy():
    policy = guard_policy("0.0.0.0", ["llm.lan"], [], "server")

    def status(**headers) -> int:
        return decide(policy, "GET", Headers(headers=headers)).status

    assert status(host="192.168.1.5:8000") == 0  # bound to every address: an IP names no attacker's DNS
    assert status(host="llm.lan:8000", origin="http://llm.lan:8000") == 0
    assert status(host="evil.example:8000") == 421
    assert status(host="localhost.evil.example") == 421
    assert status() == 421  # no Host at all
    assert status(host="localhost:8000", origin="null") == 403  # a sandboxed page or a file:// one
    bound = guard_policy("192.168.1.5", [], [], "server")
    assert decide(bound, "GET", Headers(headers={"host": "10.0.0.7"})).status == 421
    assert decide(guard_policy("127.0.0.1", ["*"], [], "server"), "GET", Headers({"host": "a.b"})).status == 0
    keyed = guard_policy("127.0.0.1", [], [], "server", has_key=True)
    assert decide(keyed, "GET", Headers({"host": "evil.example"})).status == 0


@pytest.mark.parametrize(
    "hosts, origins, key",
    [
        (["http://llm.lan"], [], "allowed_hosts"),
        (["llm.lan:80"], [], "allowed_hosts"),
        ([], ["llm.lan"], "allowed_origins"),
    ],
)
def test_bad_lists_name_their_key(hosts, origins, key):
    with pytest.raises(ConfigError) as err:
        guard_policy("127.0.0.1", hosts, origins, "router")
    assert err.value.param == f"router.{key}"


def test_exposure_without_a_key():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        assert check_exposure(host, False, False, "server") is None
    assert check_exposure("0.0.0.0", True, False, "server") is None
    with pytest.raises(ConfigError) as err:
        check_exposure("0.0.0.0", False, False, "server")
    assert err.value.param == "server.allow_no_key"
    assert "ANYONE" in check_exposure("192.168.1.5", False, True, "server")


def test_run_refuses_a_network_address_without_a_key(tmp_path):
    cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--host", "0.0.0.0", "--model", str(tmp_path / "none")]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "server.allow_no_key = true" in refused.stderr, refused.stderr
    config = tmp_path / "c.toml"
    config.write_text("[server]\nallow_no_key = true\n")
    allowed = subprocess.run([*cmd, "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert "ANYONE WHO CAN REACH IT CAN USE IT" in allowed.stderr, allowed.stderr  # then the missing model stops it


def test_router_refuses_a_network_address_without_a_key():
    args = ["router", "--backend", "http://127.0.0.1:9", "--host", "0.0.0.0"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "router.allow_no_key = true" in result.output, result.output


def test_the_router_refuses_pages_and_rebinding_and_strips_browser_headers():
    backend = FakeBackend("a").start()
    config = RouterConfig(backends=[backend.url], health_interval_s=0.2, allowed_origins=["https://app.example"])
    router = ServerThread(create_router_app(config, tokenizer=ByteTokenizer(), client_key="", backend_key=""))
    try:
        url = router.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        evil = httpx.post(url, json=body, headers={**TEXT_PLAIN, "Origin": EVIL}, timeout=10)
        assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
        rebound = httpx.get(router.url + "/health", headers={"Host": f"evil.example:{router.port}"}, timeout=10)
        assert rebound.status_code == 421
        assert not [seen for seen in backend.seen if seen[0] == "/v1/chat/completions"]  # nothing reached it
        assert httpx.post(url, json=body, timeout=10).status_code == 200  # no Origin: served
        own = httpx.post(url, json=body, headers={"Origin": router.url}, timeout=10)
        assert own.status_code == 200, own.text
        allowed = httpx.post(url, json=body, headers={"Origin": "https://app.example"}, timeout=10)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
        forwarded = [headers for path, headers, _ in backend.seen if path == "/v1/chat/completions"]
        assert len(forwarded) == 3 and not any("origin" in h for h in forwarded)
    finally:
        router.stop()
        backend.stop()
