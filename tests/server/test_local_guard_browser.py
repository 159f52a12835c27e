"""A web page on another origin, in headless Chromium, can neither run a request on a local server without
a key nor read one (issue 46): its no-cors POST and its form POST are refused before they run, its CORS
read is blocked, and a DNS-rebinding name (emulated with Chromium's host resolver rules) gets 421. The
attacker's page comes from a tiny http.server on another port, under the name evil.example.

Skipped as tests/server/test_ui_browser.py is where Chromium, chromedriver or selenium is missing.
"""

import http.server
import json
import os
import threading

import httpx
import pytest
from conftest import ServerProcess, free_port
from test_ui_browser import CHROMEDRIVER, CHROMIUM, pytestmark, webdriver  # noqa: F401 (pytestmark: the skip)

SECRET = "the marmalade-otter passphrase"
ATTACK = """<!doctype html><title>a page</title><body><script>
window.attack = async (server) => {
  const out = {};
  const chat = JSON.stringify({messages: [{role: "user", content: "page prompt"}], max_tokens: 4});
  try {
    await fetch(server + "/v1/chat/completions", {method: "POST", mode: "no-cors",
      headers: {"content-type": "text/plain"}, body: chat});
    out.no_cors = "sent";
  } catch (e) { out.no_cors = "error " + e.name; }
  try {
    const r = await fetch(server + "/v1/cache/requests");
    out.read = "read " + (await r.text());
  } catch (e) { out.read = "blocked " + e.name; }
  const sink = document.createElement("iframe");
  sink.name = "sink";
  document.body.appendChild(sink);
  await new Promise((done) => {
    sink.onload = done;
    const form = document.createElement("form");
    Object.assign(form, {method: "POST", action: server + "/v1/cache/flush", enctype: "text/plain", target: "sink"});
    const field = document.createElement("input");
    Object.assign(field, {name: '{"ssd": false, "x": "', value: '"}'});
    form.appendChild(field);
    document.body.appendChild(form);
    form.submit();
  });
  out.form = "submitted";
  return out;
};
</script></body>"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def attacker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evil")
    (folder / "index.html").write_text(ATTACK)
    handler = lambda *a, **k: _Quiet(*a, directory=str(folder), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://evil.example:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--host-resolver-rules=MAP evil.example 127.0.0.1")  # the attacker's DNS, rebound
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # Chromium crashes with blas_exec's
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER, env=env))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("guard-home")).wait_ready()
    yield server
    server.stop()


def snapshot(server) -> tuple[int, list]:
    stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=10).json()
    requests = httpx.get(server.base_url + "/v1/cache/requests", timeout=10).json()["requests"]
    return stats["kv_ram_blocks"], requests


def test_a_page_on_another_origin_can_neither_run_nor_read(browser, attacker, server):
    chat = {"messages": [{"role": "user", "content": f"{SECRET}. " * 30}], "max_tokens": 4, "temperature": 0}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    blocks, requests = snapshot(server)
    assert blocks > 0 and len(requests) == 1

    browser.get(attacker + "/index.html")
    out = browser.execute_async_script(
        "window.attack(arguments[0]).then(arguments[arguments.length - 1])", server.base_url
    )
    assert out["no_cors"] == "sent" and out["form"] == "submitted", out  # the browser sent both
    assert out["read"].startswith("blocked"), out  # no CORS header: the page reads nothing
    assert snapshot(server) == (blocks, requests)  # nothing ran, nothing was flushed

    rebound = f"http://evil.example:{server.port}"  # the page's name, now pointing at the server
    browser.get(rebound + "/v1/cache/requests")
    page = browser.find_element("tag name", "body").text
    assert SECRET not in page and json.loads(page)["error"]["code"] == "host_not_allowed", page
    assert snapshot(server) == (blocks, requests)

    browser.get(server.base_url + "/ui")  # the server's own page still works, by its own name
    own = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch("/v1/cache/flush", {method: "POST", headers: {"content-type": "application/json"}, body: "{}"})
          .then((r) => done(r.status), (e) => done(String(e)));"""
    )
    assert own == 200 and snapshot(server)[0] == 0
