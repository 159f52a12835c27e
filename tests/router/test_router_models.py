"""The router routes by model first (issue 27): what each backend's /health says it serves, a backend with
the request's model loaded before one that has it registered, a 404 naming the served models when none has
it, then the cache policy among the chosen; a request naming no model goes anywhere. Pure parts without a
server; the whole path against fake backends on loopback that report models as a server with [[models]]."""

from __future__ import annotations

import json

import httpx
import pytest
from routerharness import BS, ByteTokenizer, FakeBackend, ServerThread, chat_tokens, wait_for
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.config import RouterConfig
from mlx_kvserve.errors import NotFoundError
from mlx_kvserve.router.app import create_router_app
from mlx_kvserve.router.backends import BackendState
from mlx_kvserve.router.models import ModelReport, by_model, model_rank, parse_health_models
from mlx_kvserve.router.policies import NoBackendError
from mlx_kvserve.router.prompts import PromptInfo
from mlx_kvserve.router.proxy import Router


def rows(**states: str) -> list[dict]:
    return [{"id": m, "aliases": [f"{m}-alias"], "state": s} for m, s in states.items()]


def test_health_reports_parse_into_ids_aliases_and_states():
    report = parse_health_models({"model": "x", "models": rows(x="loaded", y="unloaded")})
    assert report.ids == {"x": "x", "x-alias": "x", "y": "y", "y-alias": "y"}
    assert report.states == {"x": "loaded", "y": "unloaded"}
    one = parse_health_models({"status": "ok", "model": "SmolLM2"})  # a server without [[models]]
    assert one == ModelReport({"SmolLM2": "SmolLM2"}, {"SmolLM2": "loaded"})
    for junk in (None, [], {"status": "ok"}, {"models": "x"}, {"models": [{"id": 5}, "y", {"state": "loaded"}]}):
        assert parse_health_models(junk) is None
    odd = parse_health_models({"models": [{"id": "z", "aliases": [3, "z2"], "state": None}]})
    assert odd.ids == {"z": "z", "z2": "z"} and odd.states == {"z": "unloaded"}


def test_ranks_prefer_loaded_then_registered_and_unknown_backends_may_serve_anything():
    report = parse_health_models({"models": rows(x="loaded", y="loading")})
    assert [model_rank(report, m) for m in ("x", "x-alias", "y", "z")] == [2, 2, 1, 0]
    assert model_rank(None, "z") == 1 and model_rank(report, "default") == 1 and model_rank(report, None) == 1
    assert by_model([1, 2, 0, 2]) == [1, 3] and by_model([1, 0, 1]) == [0, 2] and by_model([0, 0]) == []


def router_over(*reports: ModelReport | None) -> Router:
    backends = []
    for i, report in enumerate(reports):
        b = BackendState(f"http://b{i}", block_size=BS)
        b.set_models(report)
        backends.append(b)
    return Router(backends, client=None, policy="unified")


def test_pick_goes_where_the_model_is_loaded_even_against_a_cache_hit():
    x_loaded = parse_health_models({"models": rows(x="loaded", y="unloaded")})
    y_loaded = parse_health_models({"models": rows(x="unloaded", y="loaded")})
    router = router_over(x_loaded, y_loaded, None)
    info = PromptInfo(list(range(4 * BS)), None, False, "y")
    assert router.pick(info).backend.url == "http://b1"
    assert router.pick(info._replace(model="x-alias")).backend.url == "http://b0"
    # b1 failed (excluded): next are those that have y registered: b0, and b2 whose models are unknown
    assert [b.url for b in router.serving("y", frozenset({"http://b1"}))] == ["http://b0", "http://b2"]
    assert router.pick(info, frozenset({"http://b1"})).backend.url == "http://b2"  # the policy: b0 holds one
    # No model named: every backend's default serves it.
    assert len(router.serving(None)) == len(router.serving("default")) == 3


def test_a_model_no_backend_serves_is_a_404_naming_the_served_ones():
    router = router_over(parse_health_models({"models": rows(x="loaded")}), parse_health_models({"model": "SmolLM2"}))
    with pytest.raises(NotFoundError) as caught:
        router.pick(PromptInfo(None, None, False, "gpt-5"))
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    assert "'SmolLM2', 'x'" in caught.value.message
    with pytest.raises(NoBackendError, match="no other backend serves model 'x'"):
        router.pick(PromptInfo(None, None, False, "x"), frozenset({"http://b0"}))
    assert router.any_backend(model="SmolLM2").url == "http://b1"


class ModelBackend(FakeBackend):
    """A fake backend whose /health reports models as a server with [[models]] does."""

    def __init__(self, name: str, states: dict[str, str]):
        super().__init__(name)
        self.states = states

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": next(iter(self.states)), "models": rows(**self.states)})


@pytest.fixture
def served():
    backends = [
        ModelBackend("a", {"small": "loaded", "coder": "unloaded"}).start(),
        ModelBackend("b", {"small": "unloaded", "coder": "loaded"}).start(),
        ModelBackend("c", {"embed": "unloaded"}).start(),
    ]
    config = RouterConfig(backends=[b.url for b in backends], health_interval_s=0.1)
    router = ServerThread(create_router_app(config, tokenizer=ByteTokenizer(), client_key="", backend_key=""))
    yield router, backends
    router.stop()
    for b in backends:
        b.stop()


def chat(router, model: str | None, user: str = "hello there, a prompt") -> httpx.Response:
    body = {"messages": [{"role": "user", "content": user}], **({"model": model} if model else {})}
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)


def test_requests_go_to_the_backend_with_their_model_loaded_and_unknown_models_are_a_404(served):
    router, (a, b, c) = served
    wait_for(
        lambda: all(r["models"] for r in httpx.get(router.url + "/health").json()["backends"]), what="model reports"
    )
    rows_by_url = {r["url"]: r["models"] for r in httpx.get(router.url + "/health").json()["backends"]}
    assert rows_by_url[b.url] == {"small": "unloaded", "coder": "loaded"}
    # Warm a's cache with the prompt: the model still decides (b has coder loaded).
    a.store(chat_tokens([{"role": "user", "content": "hello there, a prompt"}]))
    for _ in range(3):
        assert chat(router, "coder").headers["x-kvserve-backend"] == b.url
        assert chat(router, "small-alias").headers["x-kvserve-backend"] == a.url
    assert chat(router, "embed").headers["x-kvserve-backend"] == c.url  # registered there only
    missing = chat(router, "gpt-5")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and "'coder', 'embed', 'small'" in error["message"]
    assert json.loads(json.dumps([p for p, _, _ in b.seen])) == ["/v1/chat/completions"] * 3
    body = {"model": "gpt-5", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    reply = httpx.post(router.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    assert chat(router, None).status_code == 200  # no model named: any backend
