"""`mlx-kvserve cache …` against a real server, `cache verify` offline, and pin_on_start."""

import json

import httpx
from click.testing import CliRunner

from mlx_kvserve.cli import cli

SYSTEM = " ".join(f"Policy {i}: every harbour report lists tide, wind and visibility." for i in range(6))


def run(*args):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_cache_commands_against_a_server(start_server, tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir)
    system_file = tmp_path / "system.txt"
    system_file.write_text(SYSTEM)
    url = ["cache", "--url", server.base_url]
    code, out = run(*url, "pin", "--file", str(system_file))
    pins = httpx.get(f"{server.base_url}/v1/cache/pins").json()["pins"]
    assert pins and all(p["pin_count"] == 1 for p in pins)
    # in blocks, as the pins list counts them (the server's pinned_count is 1: one chain)
    assert code == 0 and out.startswith(f"pinned {len(pins)} blocks (") and out.strip().endswith("as 1 chain"), out
    code, out = run(*url, "pins")
    assert code == 0 and all(p["block_hash"] in out for p in pins)
    code, out = run("cache", "stats", "--url", server.base_url)  # options after the subcommand too
    assert code == 0 and f"pins: {len(pins)} blocks pinned" in out, out
    assert "cache hits: " in out and "% of prompt tokens" in out and " GiB" in out and "writer: " in out
    code, out = run("cache", "stats", "--json", "--url", server.base_url)
    assert code == 0 and json.loads(out)["kv_pinned_blocks"] == len(pins)
    code, out = run(*url, "flush", "--ssd")
    assert code == 0 and "ram_dropped" in out
    assert len(httpx.get(f"{server.base_url}/v1/cache/pins").json()["pins"]) == len(pins)
    code, out = run(*url, "unpin", "--file", str(system_file))
    assert code == 0 and out.strip() == "removed 1 pin"
    assert httpx.get(f"{server.base_url}/v1/cache/pins").json()["pins"] == []
    code, out = run(*url, "prune")
    assert code == 0 and out.startswith("pruned ")
    code, out = run(*url, "pin", "zz")
    assert code == 1 and "422" in out
    code, out = run("cache", "--url", "http://127.0.0.1:9", "stats")
    assert code == 1 and "cannot reach" in out
    code, out = run("cache", "pins", "--url", "http://127.0.0.1:9/")
    assert code == 1 and "cannot reach the server at http://127.0.0.1:9:" in out


def test_verify_offline_finds_and_removes_damaged_files(start_server, tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    server = start_server(tiny_model_dir, home=home)
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert server.stop() == 0
    kv = home / "kv"
    code, out = run("cache", "verify", "--dir", str(kv))
    assert code == 0, out
    files = sorted(p for p in kv.rglob("*.safetensors") if "tails" not in p.parts)
    data = bytearray(files[0].read_bytes())
    data[-10] ^= 0xFF
    files[0].write_bytes(bytes(data))
    code, out = run("cache", "verify", "--dir", str(kv))
    assert code == 1 and not files[0].exists()
    row = out.splitlines()[2].split()
    assert row[0] == tiny_model_dir.name and row[2] == str(len(files) - 1) and row[5] == "1"  # blocks, invalid
    assert run("cache", "verify", "--dir", str(kv))[0] == 0  # repaired
    # A crash before the first index write leaves block files and no index: still verified.
    (index,) = kv.glob("*/index.json")
    index.unlink()
    data = bytearray(files[1].read_bytes())
    data[-10] ^= 0xFF
    files[1].write_bytes(bytes(data))
    code, out = run("cache", "verify", "--dir", str(kv))
    assert code == 1 and not files[1].exists(), out
    assert out.splitlines()[2].split()[2] == str(len(files) - 2) and index.exists()


def test_pin_on_start_warms_and_pins(start_server, tiny_model_dir, tmp_path):
    system_file = tmp_path / "system.txt"
    system_file.write_text(SYSTEM)
    config = tmp_path / "pins.toml"
    config.write_text(f'[cache]\npin_on_start = ["{system_file}", "{tmp_path / "missing.txt"}"]\n')
    server = start_server(tiny_model_dir, config=config)
    pins = httpx.get(f"{server.base_url}/v1/cache/pins").json()["pins"]
    assert len(pins) >= 3
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(pins) * 64
    assert "missing.txt not pinned" in server.log()
    assert server.stop() == 0
    again = start_server(tiny_model_dir, config=config)  # same home: pins persisted
    counts = [p["pin_count"] for p in httpx.get(f"{again.base_url}/v1/cache/pins").json()["pins"]]
    assert counts == [1] * len(pins)  # pin_on_start pins once, not once per start
