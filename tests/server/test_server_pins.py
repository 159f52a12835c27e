"""Pins and cache administration over HTTP against a real server on the tiny model."""

import time

import httpx
import pytest

BLOCK = 64


def system_text(tag: str, n: int = 6) -> str:
    return " ".join(f"[{tag}] rule {i}: keep the answer about lighthouse {i} short and exact." for i in range(n))


def chat_body(tag: str, question: str = "Which lighthouse is tallest?", **extra) -> dict:
    return {
        "messages": [{"role": "system", "content": system_text(tag)}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def post(server, path, body=None, **kw):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120, **kw)


def cached(server, tag: str, question: str = "Which lighthouse is tallest?") -> int:
    r = post(server, "/v1/chat/completions", chat_body(tag, question))
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def settled_stats(server, timeout: float = 60.0) -> dict:
    """Cache stats once the SSD writer has nothing queued or in progress: its writes (and the
    evictions they make) run in the background, after the responses that caused them."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{server.base_url}/v1/cache/stats", timeout=10).json()
        if stats.get("writer_queue_depth", 0) == 0 and stats.get("writer_pending", 0) == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def pins(server) -> dict[str, int]:
    r = httpx.get(f"{server.base_url}/v1/cache/pins", timeout=10)
    assert r.status_code == 200
    return {p["block_hash"]: p["pin_count"] for p in r.json()["pins"]}


@pytest.fixture(scope="module")
def server(start_module_server, tiny_model_dir):
    return start_module_server(tiny_model_dir)


def test_pin_before_first_use_then_hit(server):
    messages = chat_body("alpha")["messages"][:1]
    r = post(server, "/v1/cache/pin", {"messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    body = r.json()
    n = len(body["block_hashes"])
    assert n >= 3 and body["pinned_count"] == 1 and body["tokens"] == n * BLOCK
    assert pins(server) == {h: 1 for h in body["block_hashes"]}  # the whole chain is pinned
    assert cached(server, "alpha") >= n * BLOCK  # prefilled by the pin: the first request hits
    post(server, "/v1/cache/unpin", {"messages": messages, "add_generation_prompt": False})
    assert pins(server) == {}


def test_double_pin_needs_double_unpin_and_unknown_hash_counts_zero(server):
    r = post(server, "/v1/chat/completions", chat_body("beta", kvserve={"return_block_hashes": True}))
    hashes = r.json()["kvserve"]["block_hashes"]
    assert len(hashes) >= 3
    for _ in range(2):
        assert post(server, "/v1/cache/pin", {"block_hashes": hashes[-1:]}).json()["pinned_count"] == 1
    assert pins(server)[hashes[0]] == 2
    assert post(server, "/v1/cache/unpin", {"block_hashes": hashes[-1:]}).json()["unpinned_count"] == 1
    assert pins(server)[hashes[-1]] == 1
    assert post(server, "/v1/cache/unpin", {"block_hashes": hashes[-1:]}).json()["unpinned_count"] == 1
    assert pins(server) == {}
    unknown = post(server, "/v1/cache/pin", {"block_hashes": ["ab" * 32]})
    assert unknown.status_code == 200 and unknown.json()["pinned_count"] == 0


def test_flush_keeps_pins(server):
    keep = post(server, "/v1/cache/pin", {"messages": chat_body("gamma")["messages"]}).json()
    assert keep["pinned_count"] == 1
    cached(server, "delta")  # cache another prompt
    r = post(server, "/v1/cache/flush", {"ssd": True})
    assert r.status_code == 200, r.text
    assert r.json()["ram_dropped"] > 0 and r.json()["ssd_dropped"] > 0
    assert cached(server, "delta") == 0  # flushed from RAM and SSD
    assert cached(server, "gamma") >= len(keep["block_hashes"]) * BLOCK
    post(server, "/v1/cache/unpin", {"block_hashes": keep["block_hashes"][-1:]})


def test_bad_input_gets_4xx(server):
    cases = [
        ({"block_hashes": ["not-hex"]}, 422),
        ({"block_hashes": []}, 422),
        ({}, 422),
        ({"prompt": "x", "block_hashes": ["ab" * 32]}, 422),
        ({"prompt": "too short"}, 400),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 422),
    ]
    for body, status in cases:
        r = post(server, "/v1/cache/pin", body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    assert post(server, "/v1/cache/flush", {"ssd": "yes"}).status_code == 422
    assert httpx.post(f"{server.base_url}/v1/cache/pin", content=b"{", timeout=10).status_code == 400
    stats = httpx.get(f"{server.base_url}/v1/cache/stats", timeout=10).json()
    assert stats["enabled"] is True and "kv_pinned_blocks" in stats


def _flood_config(tmp_path, ttl_days=7.0):
    path = tmp_path / "flood.toml"
    path.write_text(
        f'[cache]\nram_max_bytes = "160KiB"\n[ssd]\nmax_bytes = "400KiB"\nmin_free_bytes = 0\nttl_days = {ttl_days}\n'
    )
    return path


def test_pinned_prefix_survives_a_flood_of_ram_and_ssd(start_server, tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, config=_flood_config(tmp_path))
    pinned = post(server, "/v1/cache/pin", {"messages": chat_body("pinned")["messages"]}).json()
    n = len(pinned["block_hashes"])
    cached(server, "victim")
    for i in range(12):  # several times the RAM and SSD budgets
        cached(server, f"flood{i}")
    stats = settled_stats(server)
    assert stats["kv_evictions"] > 0 and stats["ssd_evictions"] + stats["ssd_skipped_budget"] > 0
    assert cached(server, "victim") < BLOCK  # the unpinned prompt is gone
    assert cached(server, "pinned", "A brand new question?") >= n * BLOCK - BLOCK


def test_pins_survive_restart_and_prune_skips_them(start_server, tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    config = _flood_config(tmp_path, ttl_days=1e-5)  # about one second
    first = start_server(tiny_model_dir, config=config, home=home)
    pinned = post(first, "/v1/cache/pin", {"messages": chat_body("keep")["messages"]}).json()
    cached(first, "other")
    time.sleep(2.5)
    assert first.stop() == 0
    second = start_server(tiny_model_dir, config=config, home=home)  # startup prunes expired blocks
    assert pins(second) == {h: 1 for h in pinned["block_hashes"]}
    assert cached(second, "fresh") == 0
    stored = settled_stats(second)["ssd_blocks"]  # the pinned chain and "fresh"'s blocks
    time.sleep(1.5)
    # All of them expired; the pinned ones are skipped, so exactly "fresh"'s are pruned.
    assert post(second, "/v1/cache/prune").json()["pruned"] == stored - len(pinned["block_hashes"]) > 0
    assert cached(second, "keep") >= len(pinned["block_hashes"]) * BLOCK
    assert cached(second, "other") == 0


def test_safety_net_pins_beyond_ram_budget_never_fail_requests(start_server, tiny_model_dir, tmp_path):
    config = tmp_path / "tiny-ram.toml"
    config.write_text('[cache]\nram_max_bytes = "640KiB"\npinned_ram_share = 0.5\n[ssd]\nenabled = false\n')
    server = start_server(tiny_model_dir, config=config)
    for tag in ("p1", "p2", "p3"):
        r = post(server, "/v1/cache/pin", {"messages": chat_body(tag)["messages"]})
        assert r.status_code == 200 and r.json()["pinned_count"] == 1
    for i in range(4):
        r = post(server, "/v1/chat/completions", chat_body(f"req{i}"))
        assert r.status_code == 200
    stats = httpx.get(f"{server.base_url}/v1/cache/stats", timeout=10).json()
    assert stats["kv_ram_bytes"] <= stats["kv_ram_max_bytes"]
    assert stats["kv_pinned_dropped"] > 0
    assert cached(server, "req3") > 0  # requests still get cached despite the pins
