"""What a newcomer meets (issue 49): `GET /` pointing to /ui and the API, the dashboard address in the
startup log, /ui's polls kept out of the INFO log."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient
from test_api_anthropic import _loaded
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.root_page import dashboard_url


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path_factory.mktemp("newcomer"))


def test_the_root_points_to_the_dashboard_and_the_api(engine, caplog):
    with caplog.at_level(logging.INFO), TestClient(create_app(engine, ApiKeys("", ""))) as client:
        body = client.get("/").json()
        page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
        assert client.head("/").status_code == 200
    assert body["dashboard"] == "/ui" and body["links"]["health"] == "/health"
    assert body["links"]["chat_completions"] == "/v1/chat/completions" and body["name"] == "mlx-kvserve"
    assert page.headers["content-type"].startswith("text/html")
    assert '<a href="/ui">' in page.text and '<a href="/health">' in page.text and "tiny" in page.text
    assert "dashboard: http://127.0.0.1:8000/ui" in caplog.text


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000/ui"),
        ("0.0.0.0", "http://127.0.0.1:8000/ui"),
        ("::1", "http://[::1]:8000/ui"),
    ],
)
def test_the_dashboard_address_is_one_to_open(host, url):
    assert dashboard_url(host, 8000) == url
