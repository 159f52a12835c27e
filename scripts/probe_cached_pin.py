"""Issue 46's PIN probe against real servers (SmolLM2), one per cache setting, side by side: key A's
system prompt holds a 4-digit PIN; key B guesses it digit by digit through `cached_tokens`
(harness/pin_probe.py). Prints, per setting, what B read, how many requests it took and how long.

    python scripts/probe_cached_pin.py [--pin 4821]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import openai
from harness import default_model_dir
from harness.pin_probe import messages, probe_pin, victim_system
from harness.servers import Server, free_port, server_env, toml_text

KEY_A, KEY_B = "sk-probe-a", "sk-probe-b"
SETTINGS = {
    "per_key": {},
    "shared, exact": {"isolation": "shared", "report_cached": "exact"},
    "shared, blocks": {"isolation": "shared", "report_cached": "blocks"},
}


def start(model_dir: Path, cache: dict, home: Path) -> Server:
    (home / "keys").write_text(f"a: {KEY_A}\nb: {KEY_B}\n")
    config = {"server": {"api_key_file": str(home / "keys")}, "generation": {"temperature": 0.0}}
    (home / "config.toml").write_text(toml_text({**config, "cache": cache} if cache else config))
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model_dir), "--port", str(port)]
    server = Server(
        "ours",
        [*cmd, "--config", str(home / "config.toml")],
        port,
        dict(server_env(), MLX_KVSERVE_HOME=str(home)),
        "/health",
    )
    server.wait("/health")
    return server


def cached_tokens(server: Server, key: str, system: str) -> int:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="default", messages=messages(system), max_tokens=1)
    return reply.usage.prompt_tokens_details.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", default="4821")
    args = parser.parse_args()
    model_dir = default_model_dir()
    print(f"{'cache':<16} {'read':<6} {'requests':>8} {'seconds':>8}  first digit's readings")
    for name, cache in SETTINGS.items():
        home = Path(tempfile.mkdtemp(prefix="kvserve-probe-"))
        try:
            server = start(model_dir, cache, home)
            try:
                cached_tokens(server, KEY_A, victim_system(args.pin))
                result = probe_pin(lambda system, server=server: cached_tokens(server, KEY_B, system))
            finally:
                server.stop()
        finally:
            shutil.rmtree(home, ignore_errors=True)
        read = result.pin or "-"
        print(f"{name:<16} {read:<6} {result.requests:>8} {result.seconds:>8.1f}  {result.readings[0]}")


if __name__ == "__main__":
    main()
