"""The /ui page without a browser: its files, their content types and headers, the recent requests log,
and the keys: without the admin key a client gets the page shell and no prompt text anywhere.
The page in a real browser: tests/server/test_ui_browser.py."""

import re

import httpx
import pytest

from mlx_kvserve.server.metrics import RequestRecord
from mlx_kvserve.server.ui import RecentRequests, asset

API_KEY, ADMIN_KEY = "inference-key-1", "admin-key-1"
SECRET = "the zebra-violet lighthouse secret"  # prompt text no one without the admin key may read
ASSETS = {
    "/ui": "text/html",
    "/ui/app.js": "text/javascript",
    "/ui/api.js": "text/javascript",
    "/ui/chat.js": "text/javascript",
    "/ui/ui.css": "text/css",
    "/ui/uPlot.iife.min.js": "text/javascript",
    "/ui/uPlot.min.css": "text/css",
    "/ui/uPlot.LICENSE.txt": "text/plain",
}


def test_asset_lookup_never_leaves_its_folder():
    assert asset("index.html").content_type.startswith("text/html")
    assert asset("app.js").content_type.startswith("text/javascript")
    for name in ("../__init__.py", "..", ".hidden", "static/app.js", "nope.js", "__init__.py", "a\\b.js", ""):
        assert asset(name) is None, name


def test_recent_requests_keep_the_last_ones_without_text():
    log = RecentRequests(capacity=3, clock=lambda: 100.0)
    for i in range(5):
        record = RequestRecord(f"req-{i}", "POST", "/v1/chat/completions", 0.0, endpoint="/v1/chat/completions")
        record.status, record.prompt_tokens, record.cached_tokens, record.first_token_s = 200, 100, 64, 0.0123456
        log.add(record)
    items = log.items()
    assert [r["id"] for r in items] == ["req-2", "req-3", "req-4"]
    assert items[-1] | {} == {
        "id": "req-4",
        "endpoint": "/v1/chat/completions",
        "status": 200,
        "stream": False,
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "completion_tokens": 0,
        "ttft_s": 0.0123,
        "duration_s": 0.0,
        "error": None,
        "finished_at": 100.0,
    }


@pytest.fixture(scope="module")
def server(start_module_server, tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ui-keys")
    config = folder / "config.toml"
    config.write_text(f'[server]\napi_key = "{API_KEY}"\nadmin_api_key = "{ADMIN_KEY}"\n')
    server = start_module_server(tiny_model_dir, config=config)
    body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 3, "temperature": 0}
    for _ in range(2):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=bearer(API_KEY), timeout=60)
        assert r.status_code == 200, r.text
    return server


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_page_and_assets_are_served_without_a_key(server):
    for path, kind in ASSETS.items():
        r = httpx.get(server.base_url + path, timeout=10)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith(kind), (path, r.headers["content-type"])
        assert r.headers["x-content-type-options"] == "nosniff"
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["referrer-policy"] == "no-referrer"
        assert "set-cookie" not in r.headers


def test_every_script_and_stylesheet_of_the_page_is_local(server):
    page = httpx.get(server.base_url + "/ui", timeout=10).text
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(ref.startswith(("/ui/", "#", "data:")) for ref in refs), refs
    for ref in (r for r in refs if r.startswith("/ui/")):
        assert httpx.get(server.base_url + ref, timeout=10).status_code == 200, ref
    for module in ("app.js", "live.js", "pins.js", "cache.js", "requests.js", "chat.js"):
        text = httpx.get(f"{server.base_url}/ui/{module}", timeout=10).text
        for imported in re.findall(r'from "\./([^"]+)"', text):
            assert httpx.get(f"{server.base_url}/ui/{imported}", timeout=10).status_code == 200, imported
        assert "http://" not in text and "https://" not in text and "innerHTML" not in text


def test_unknown_files_and_methods(server):
    assert httpx.get(server.base_url + "/ui/missing.js", timeout=10).status_code == 404
    assert httpx.get(server.base_url + "/ui/%2e%2e/__init__.py", timeout=10).status_code == 404
    assert httpx.get(server.base_url + "/ui/", timeout=10).status_code == 404
    assert httpx.post(server.base_url + "/ui", timeout=10).status_code == 405


def test_requests_log_needs_the_admin_key(server):
    url = f"{server.base_url}/v1/cache/requests"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=bearer(API_KEY), timeout=10).status_code == 401
    r = httpx.get(url, headers=bearer(ADMIN_KEY), timeout=10)
    assert r.status_code == 200
    chats = [x for x in r.json()["requests"] if x["endpoint"] == "/v1/chat/completions"]
    assert len(chats) >= 2 and chats[-1]["status"] == 200 and chats[-1]["prompt_tokens"] > 0
    assert chats[-1]["ttft_s"] > 0 and chats[-1]["cached_tokens"] > 0  # the second one repeated the first
    assert SECRET not in r.text


def test_without_the_admin_key_no_prompt_text_anywhere(server):
    """Everything a client without the admin key can fetch: the page, its files, /health; the admin
    routes answer 401 and the inference key opens nothing under /v1/cache/."""
    seen = [httpx.get(server.base_url + path, timeout=10) for path in [*ASSETS, "/health"]]
    assert all(r.status_code == 200 for r in seen)
    for path in ("/v1/cache/requests", "/v1/cache/pins", "/v1/cache/stats", "/metrics"):
        r = httpx.get(server.base_url + path, timeout=10)
        assert r.status_code == 401, path
        seen.append(r)
    for path in ("/v1/cache/requests", "/v1/cache/pins"):
        assert httpx.get(server.base_url + path, headers=bearer(API_KEY), timeout=10).status_code == 401
    for r in seen:
        assert SECRET not in r.text and "zebra" not in r.text, r.url


def test_router_serves_its_own_page_outside_its_key():
    from starlette.testclient import TestClient

    from mlx_kvserve.config import RouterConfig
    from mlx_kvserve.router.app import create_router_app

    app = create_router_app(RouterConfig(backends=["http://127.0.0.1:9"]), tokenizer=object(), client_key="rk")
    client = TestClient(app)  # no lifespan: the page and the key check need none
    page = client.get("/ui")
    assert page.status_code == 200 and "router.js" in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    js = client.get("/ui/router.js")
    assert js.headers["content-type"].startswith("text/javascript")
    imported = re.findall(r'from "\./([^"]+)"', js.text)
    assert imported and all(client.get(f"/ui/{name}").status_code == 200 for name in imported)
    assert client.get("/metrics").status_code == 401  # the page's data still needs the router's key
    assert client.get("/metrics", headers=bearer("rk")).status_code == 200
