"""The /ui page in headless Chromium (Selenium, pointed at the system's chromium and chromedriver).

Skipped, saying why, where either binary or the selenium package is missing (Debian:
`apt-get install chromium chromium-driver`, or `bash scripts/install.sh chromium`); failed instead
where CI=true (.ci/run sets it), as is tests/server/test_local_guard_browser.py, which imports this. With
KVSERVE_UI_SCREENSHOTS=1 the run also writes the docs' screenshots, docs/img/ui-*.png.
"""

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

ADMIN_KEY = "admin-key-2"
SECRET = "the quince-harbour lighthouse secret"
SYSTEM = " ".join(f"Rule {i}: answer as the keeper of lighthouse number {i}, briefly." for i in range(8))
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def _binary(env: str, *names: str) -> str | None:
    return os.environ.get(env) or next((p for n in names if (p := shutil.which(n))), None)


CHROMIUM = _binary("KVSERVE_CHROMIUM", "chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = _binary("KVSERVE_CHROMEDRIVER", "chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - depends on the machine
    webdriver = None

MISSING = webdriver is None or CHROMIUM is None or CHROMEDRIVER is None
WHY = (
    "browser tests need the selenium package and a chromium + chromedriver on PATH "
    "(Debian: apt-get install chromium chromium-driver; or bash scripts/install.sh chromium)"
)
if MISSING and os.environ.get("CI") == "true":  # CI (.ci/run) must not turn green with the browser claims dropped
    pytest.fail(f"CI=true: {WHY}", pytrace=False)
pytestmark = pytest.mark.skipif(MISSING, reason=WHY)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Not the OpenBLAS that blas_exec preloads for MLX: Chromium's renderer crashes with it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER, env=env)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def console_errors(driver, allowed: tuple[str, ...] = ()) -> list[str]:
    entries = driver.get_log("browser")
    return [e["message"] for e in entries if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)]


def wait_for(driver, condition, timeout: float = 60.0):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d))


def polls(driver) -> int:
    return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-polled") or 0)


def open_tab(driver, base_url: str, tab: str) -> None:
    if not driver.current_url.startswith(base_url + "/ui"):
        driver.get(f"{base_url}/ui#{tab}")
    else:
        driver.execute_script("location.hash = arguments[0]", tab)
    wait_for(driver, lambda d: d.find_element(By.ID, tab).is_displayed())


def field(driver, name: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'[data-field="{name}"]').get_attribute("data-value")


def screenshot(driver, name: str) -> None:
    if os.environ.get("KVSERVE_UI_SCREENSHOTS") == "1":
        time.sleep(0.5)  # let the charts draw their last poll
        driver.save_screenshot(str(DOCS_IMG / f"ui-{name}.png"))


def chat(server, content: str, system: str = SYSTEM, **headers) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    body |= {"max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def settled_health(server, timeout: float = 60.0) -> dict:
    """/health once the SSD writer is idle (its counters move after the responses)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{server.base_url}/health", timeout=10).json()
        cache = health["cache"]
        if cache.get("writer_queue_depth", 0) == 0 and cache.get("writer_pending", 0) == 0:
            return health
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ui-home")


@pytest.fixture(scope="module")
def open_server(tiny_model_dir, home):
    """A server with no key (the admin API open, as on localhost by default); restarted by one test."""
    server = ServerProcess(tiny_model_dir, home).wait_ready()
    holder = {"server": server}
    yield holder
    holder["server"].stop()


def test_figures_match_health_without_console_errors(browser, open_server):
    server = open_server["server"]
    for question in ("Which light is tallest?", "Which light is oldest?", "Which light is tallest?"):
        chat(server, question)
    open_tab(browser, server.base_url, "overview")
    health = settled_health(server)
    seen = polls(browser)
    wait_for(browser, lambda d: polls(d) >= seen + 2)  # two polls after the server went idle
    cache, batch = health["cache"], health["batch"]
    assert float(field(browser, "batch.decode_tokens_per_s")) == batch["decode_tokens_per_s"]
    assert float(field(browser, "batch.running")) == batch["running"] == 0
    assert float(field(browser, "cached_share")) > 0
    assert float(field(browser, "ttft_hit_median")) > 0 and float(field(browser, "ttft_cold_median")) > 0
    # the memory plan at start, as /health tells it (engine/memory/plan.py)
    assert browser.find_element(By.ID, "memory-plan").text == health["memory_plan"]["line"]
    assert "largest context" in health["memory_plan"]["line"]
    screenshot(browser, "overview")
    open_tab(browser, server.base_url, "cache")
    for name in ("kv_ram_blocks", "kv_ram_bytes", "kv_hits", "kv_tails", "ssd_blocks", "ssd_bytes", "writer_written"):
        assert float(field(browser, f"cache.{name}")) == cache[name], name
    screenshot(browser, "cache")
    # What the cache did: a hit is a prompt at least half cached; the time saved is its cached tokens at
    # the measured prefill rate (the first request shared nothing: cold).
    log = httpx.get(f"{server.base_url}/v1/cache/requests", timeout=10).json()["requests"]
    rate = batch["prefill_tokens_per_s"]
    saved = sum(r["cached_tokens"] for r in log) / rate
    assert float(field(browser, "prefill_saved_s")) == pytest.approx(saved, rel=1e-6) and saved > 0
    legends = [e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, ".u-legend")]
    assert len(legends) == 5 and all("--" not in legend for legend in legends)  # labels, no empty values
    assert "cache hit (≥ half cached)" in legends[2] and "cache hit (≥ half cached)" in legends[4]
    # TTFT against prompt length: every listed request a point, cold and hits apart, x ascending
    by_length = browser.find_element(By.ID, "chart-ttft-length")
    cold = sum(r["cached_tokens"] < r["prompt_tokens"] / 2 for r in log)
    assert (by_length.get_attribute("data-cold"), by_length.get_attribute("data-hit")) == (str(cold), str(3 - cold))
    assert cold >= 1 and 3 - cold >= 1
    lengths = by_length.get_attribute("data-prompt-tokens")
    assert lengths == ",".join(str(n) for n in sorted(r["prompt_tokens"] for r in log))
    assert by_length.find_elements(By.TAG_NAME, "canvas")
    open_tab(browser, server.base_url, "requests")
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests-table tbody tr")
    assert len(rows) == 3 and "/v1/chat/completions" in rows[0].text
    newest = log[-1]
    cells = rows[0].find_elements(By.TAG_NAME, "td")
    assert cells[6].text == f"{100 * newest['cached_tokens'] / newest['prompt_tokens']:.1f} %"
    assert float(rows[0].get_attribute("data-saved-s")) == pytest.approx(newest["cached_tokens"] / rate, rel=1e-6)
    assert cells[7].text.startswith("≈ ") and cells[7].text.endswith(" ms")
    hits = [r.get_attribute("class") == "hit" for r in reversed(rows)]  # oldest first, as the log
    assert hits == [r["cached_tokens"] >= r["prompt_tokens"] / 2 for r in log] and hits[0] is False
    assert console_errors(browser) == []


def test_pin_made_in_the_page_survives_a_restart(browser, open_server, tiny_model_dir, home):
    server = open_server["server"]
    open_tab(browser, server.base_url, "pins")
    text = "You keep the pinned lighthouse log. " * 12
    browser.find_element(By.ID, "pin-text").send_keys(text)
    browser.find_element(By.ID, "pin-button").click()
    wait_for(browser, lambda d: "pinned" in d.find_element(By.ID, "pin-result").text)
    pinned = {p["block_hash"] for p in httpx.get(f"{server.base_url}/v1/cache/pins", timeout=10).json()["pins"]}
    assert len(pinned) >= 3
    rows = browser.find_elements(By.CSS_SELECTOR, "#pins-table tbody tr")
    assert {r.get_attribute("data-hash") for r in rows} == pinned
    assert "You keep the pinned" in rows[0].text  # labelled from this tab's memory, not by the server
    screenshot(browser, "pins")
    assert console_errors(browser) == []
    browser.get("about:blank")  # the page would poll the stopped server
    server.stop()
    server = open_server["server"] = ServerProcess(tiny_model_dir, home).wait_ready()
    after = {p["block_hash"] for p in httpx.get(f"{server.base_url}/v1/cache/pins", timeout=10).json()["pins"]}
    assert after == pinned
    open_tab(browser, server.base_url, "pins")
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pins-table tbody tr")) == len(pinned))
    browser.find_element(By.CSS_SELECTOR, f'#pins-table tr[data-hash="{sorted(pinned)[0]}"] button')
    assert console_errors(browser) == []


def send(driver, text: str, turn: int) -> dict:
    box = driver.find_element(By.ID, "chat-input")
    box.send_keys(text)
    driver.find_element(By.ID, "chat-send").click()
    metas = lambda d: d.find_elements(By.CSS_SELECTOR, ".turn-meta[data-cached]")  # noqa: E731
    wait_for(driver, lambda d: len(metas(d)) >= turn)
    meta = metas(driver)[turn - 1]
    reply = driver.find_elements(By.CSS_SELECTOR, ".turn.assistant .content")[turn - 1].text
    return {"cached": int(meta.get_attribute("data-cached")), "ttft": meta.get_attribute("data-ttft"), "reply": reply}


def test_playground_streams_and_shows_cached_tokens(browser, open_server):
    server = open_server["server"]
    open_tab(browser, server.base_url, "playground")
    browser.find_element(By.ID, "chat-system").send_keys("Playground. " + SYSTEM)
    browser.find_element(By.ID, "chat-max").clear()
    browser.find_element(By.ID, "chat-max").send_keys("12")
    first = send(browser, "Name one lighthouse.", 1)
    second = send(browser, "And another one?", 2)
    assert first["reply"] and second["reply"] and float(first["ttft"]) > 0
    assert second["cached"] > first["cached"] and second["cached"] >= 64  # the first turn's prompt, from cache
    log = httpx.get(f"{server.base_url}/v1/cache/requests", timeout=10).json()["requests"]
    assert log[-1]["stream"] is True and log[-1]["cached_tokens"] == second["cached"]
    screenshot(browser, "playground")
    assert console_errors(browser) == []


def test_playground_can_stop_a_reply_and_sends_nothing_meanwhile(browser, open_server):
    server = open_server["server"]
    open_tab(browser, server.base_url, "playground")
    browser.execute_script("document.getElementById('chat-max').value = '1500'")
    browser.execute_script("document.getElementById('chat-temp').value = '1'")
    send_button, stop = browser.find_element(By.ID, "chat-send"), browser.find_element(By.ID, "chat-stop")
    meta = lambda d: d.find_elements(By.CSS_SELECTOR, ".turn-meta")[-1]  # noqa: E731
    for _ in range(3):  # a sampled reply may end (EOS) before the click: ask again
        browser.find_element(By.ID, "chat-input").send_keys("Tell me a very long story.")
        send_button.click()
        wait_for(browser, lambda d: meta(d).text.startswith(("streaming… ", "prompt ")))  # shown as it comes
        stopped = browser.execute_script(
            "const busy = document.getElementById('chat-send').disabled;"
            "const stop = document.getElementById('chat-stop');"
            "if (busy && !stop.hidden) stop.click(); return busy && !stop.hidden;"
        )
        wait_for(browser, lambda d: send_button.is_enabled())
        if stopped:
            break
    assert stopped, "every reply ended before Stop could be clicked"
    wait_for(browser, lambda d: meta(d).get_attribute("data-stopped") == "true")
    assert meta(browser).text.startswith("stopped after ") and "first token after" in meta(browser).text
    assert not stop.is_displayed() and browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .content")[-1].text
    wait_for(browser, lambda d: httpx.get(f"{server.base_url}/health", timeout=10).json()["batch"]["running"] == 0, 30)
    log = httpx.get(f"{server.base_url}/v1/cache/requests", timeout=10).json()["requests"]
    assert log[-1]["completion_tokens"] < 1500  # the server stopped generating when the page left
    assert console_errors(browser) == []


@pytest.fixture(scope="module")
def keyed_server(start_module_server, tiny_model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("ui-admin") / "config.toml"
    config.write_text(f'[server]\nadmin_api_key = "{ADMIN_KEY}"\n')
    server = start_module_server(tiny_model_dir, config=config)
    chat(server, SECRET)
    chat(server, SECRET)
    return server


def test_without_the_admin_key_the_page_shows_nothing(browser, keyed_server):
    browser.get(f"{keyed_server.base_url}/ui")
    wait_for(browser, lambda d: d.find_element(By.ID, "login").is_displayed())
    assert not browser.find_element(By.ID, "tabs").is_displayed()
    assert SECRET not in browser.page_source and "quince" not in browser.page_source
    browser.find_element(By.ID, "key-input").send_keys("wrong-key")
    browser.find_element(By.CSS_SELECTOR, "#login-form button").click()
    wait_for(browser, lambda d: "refused" in d.find_element(By.ID, "login-error").text)
    screenshot(browser, "login")
    # The only errors: the refused requests themselves (Chromium logs every 401 fetch).
    assert console_errors(browser, allowed=("401",)) == []
    assert "quince" not in browser.page_source


def test_key_from_the_url_is_kept_in_session_storage_only(browser, keyed_server):
    browser.get(f"{keyed_server.base_url}/ui?key={ADMIN_KEY}#requests")
    wait_for(browser, lambda d: d.find_element(By.ID, "requests").is_displayed())
    assert "key=" not in browser.current_url
    assert browser.execute_script("return sessionStorage.getItem('mlx-kvserve.key')") == ADMIN_KEY
    assert browser.get_cookies() == []
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests-table tbody tr")) >= 2)
    assert "quince" not in browser.page_source  # the log holds counts, never text
    browser.find_element(By.ID, "forget-key").click()
    assert browser.find_element(By.ID, "login").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('mlx-kvserve.key')") is None
    assert console_errors(browser) == []


KEY_A, KEY_B = "alice-key-1", "bob-key-2"


@pytest.fixture(scope="module")
def two_key_server(start_module_server, tiny_model_dir, tmp_path_factory):
    """Two keys caching apart (isolation "auto" with a key file of two) and no admin key."""
    folder = tmp_path_factory.mktemp("ui-two-keys")
    (folder / "keys").write_text(f"alice: {KEY_A}\nbob: {KEY_B}\n")
    (folder / "config.toml").write_text(f'[server]\napi_key_file = "{folder / "keys"}"\n')
    return start_module_server(tiny_model_dir, config=folder / "config.toml")


def test_the_pins_tab_of_an_ordinary_key_says_the_list_is_the_admins_and_pins_its_own(browser, two_key_server):
    """Under per_key without an admin key, GET /v1/cache/pins is 403 for every key (it lists every key's
    blocks): the tab says so in place of the lists, shows no error, and still pins the key's own prompt."""
    server = two_key_server
    assert (
        httpx.get(f"{server.base_url}/v1/cache/pins", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 403
    )
    browser.get(f"{server.base_url}/ui?key={KEY_A}#pins")
    wait_for(browser, lambda d: d.find_element(By.ID, "pins-own").is_displayed())
    assert "server.admin_api_key" in browser.find_element(By.ID, "pins-own").text
    assert not browser.find_element(By.ID, "pins-table").is_displayed()
    assert not browser.find_element(By.ID, "leases-table").is_displayed()
    browser.find_element(By.ID, "pin-text").send_keys("Alice's own pinned instructions. " * 12)
    browser.find_element(By.ID, "pin-button").click()
    wait_for(browser, lambda d: "pinned" in d.find_element(By.ID, "pin-result").text)
    assert "bad" not in browser.find_element(By.ID, "status").get_attribute("class").split()  # no error shown
    assert console_errors(browser, allowed=("403",)) == []  # Chromium logs the refused list fetch itself
    browser.get("about:blank")
