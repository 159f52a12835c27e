"""A real server process: the first request after a restart is served from the SSD with the
same text; SIGTERM records a clean shutdown, kill -9 does not, and neither loses the cache."""

import signal
import time

import httpx
import pytest

from mlx_kvserve.kv.ssd.format import block_files

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
        # Nothing queued or being saved (a batch in flight is out of the queue but still pending),
        # and every inserted block on disk (writer_written also counts tails).
        idle = cache["writer_queue_depth"] == 0 and cache["writer_pending"] == 0
        if idle and cache["ssd_blocks"] >= cache["kv_inserts"] > 0:
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
    assert cached_again == prompt_tokens - 1  # whole blocks and the persisted tail
    after = health(second)["cache"]
    assert after["ssd_hits"] == after["kv_promotions"] == cached_again // 64 > 0


def test_kill9_while_writing_then_restart_serves_verified_blocks(start_server, tiny_model_dir, tmp_path):
    """Kill the server the moment a long prompt's answer arrives, while its blocks are still being
    written: the next start reconciles the folder and serves only blocks that verify."""
    home = tmp_path / "home"
    config = tmp_path / "slow.toml"
    config.write_text("[ssd]\nwriter_queue_size = 4\n")
    first = start_server(tiny_model_dir, config=config, home=home)
    long_system = SYSTEM.replace("harbour", "lighthouse")
    body = {
        "messages": [{"role": "system", "content": long_system}, {"role": "user", "content": "Where?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    text = httpx.post(f"{first.base_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    wait_for(lambda: health(first)["cache"]["ssd_blocks"] >= 1)  # the first blocks landed; more may be in flight
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    on_disk = block_files_under(home / "kv")

    second = start_server(tiny_model_dir, config=config, home=home)
    report = health(second)["cache"]["ssd_startup_validation"]
    # A block file is renamed into place whole, so a kill leaves none torn; every one on disk is served.
    assert report["deleted_invalid"] == 0
    assert report["kept"] + report["adopted"] == on_disk >= 1
    again = httpx.post(f"{second.base_url}/v1/chat/completions", json=body, timeout=120).json()
    assert again["choices"][0]["message"]["content"] == text["message"]["content"]
    cache = health(second)["cache"]
    assert cache["ssd_corrupt"] == 0  # nothing half-written was ever read as a block
    # RAM is empty after the restart: the prefix came from the SSD, as far as the chain's files go.
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 1 <= cache["ssd_hits"] == cached // 64 <= on_disk


def wait_for(ready, timeout=30):
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def block_files_under(kv_dir):
    """The block files (not tails, not temp files) in every namespace folder of `kv_dir`."""
    return sum(h is not None for ns in kv_dir.iterdir() if ns.is_dir() for _, h in block_files(ns))


def test_disk_full_keeps_serving(start_server, tiny_model_dir, tmp_path):
    config = tmp_path / "full.toml"
    config.write_text('[ssd]\nmin_free_bytes = "1000TiB"\n')  # as if the disk were full
    server = start_server(tiny_model_dir, config=config)
    text, _, _ = chat(server)
    again, cached, _ = chat(server)
    assert again == text and cached > 0  # RAM still serves
    cache = wait_skipped(server)
    assert cache["ssd_blocks"] == 0 and cache["ssd_skipped_low_space"] == cache["kv_inserts"] > 0


def wait_skipped(server, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        cache = health(server)["cache"]
        if cache["ssd_skipped_low_space"] >= cache["kv_inserts"] > 0:
            return cache
        time.sleep(0.1)
    return health(server)["cache"]
