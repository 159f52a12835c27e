"""A real server process: the first request after a restart is served from the SSD with the
same text; SIGTERM records a clean shutdown, kill -9 does not, and neither loses the cache."""

import signal
import time

import httpx
import pytest

SYSTEM = " ".join(f"Guideline {i}: answer about harbour number {i} with care and precision." for i in range(25))


def chat(server, question="Where is harbour 7?"):
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens_details"]["cached_tokens"], data


def health(server):
    return httpx.get(f"{server.base_url}/health", timeout=10).json()


def wait_written(server, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        cache = health(server)["cache"]
        if cache["writer_written"] >= cache["kv_inserts"] > 0 and cache["writer_queue_depth"] == 0:
            return cache
        time.sleep(0.1)
    raise AssertionError(f"writer did not catch up: {health(server)['cache']}")


@pytest.mark.parametrize("stop", ["sigterm", "kill9"])
def test_restart_serves_from_ssd(start_server, tiny_model_dir, tmp_path, stop):
    home = tmp_path / "home"
    first = start_server(tiny_model_dir, home=home)
    text, cached, usage = chat(first)
    assert cached == 0
    written = wait_written(first)
    assert written["ssd_blocks"] == written["kv_inserts"]
    if stop == "sigterm":
        assert first.stop() == 0
    else:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)

    second = start_server(tiny_model_dir, home=home)
    cache = health(second)["cache"]
    assert cache["shutdown_clean"] is (True if stop == "sigterm" else None)
    report = cache["ssd_startup_validation"]
    # After kill -9 the index may lag the files: validation adopts the files it did not know.
    assert report["kept"] + report["adopted"] == written["ssd_blocks"]
    assert report["deleted_invalid"] == 0
    again, cached_again, _ = chat(second)
    assert again == text
    prompt_tokens = usage["usage"]["prompt_tokens"]
    assert cached_again == (prompt_tokens - 1) // 64 * 64 > 0
    after = health(second)["cache"]
    assert after["ssd_hits"] == cached_again // 64 and after["kv_promotions"] == cached_again // 64
