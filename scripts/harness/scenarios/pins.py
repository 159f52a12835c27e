"""bench.py --scenarios pins's measurement, which bench.py runs too: a conversation warmed (and pinned, or not), a flood
of others far beyond the budgets, then its next turn; on our server pinned and unpinned and on
mlx_lm.server, each on a fresh server; and its report."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.clients import chat_ttft
from harness.servers import Server, free_port, kvserve_server

QUESTIONS = ["Name a river.", "Name a mountain.", "Name a desert.", "Name an ocean.", "Name a lake."]


def system(tag: str, rules: int) -> str:
    return f"Conversation {tag}.\n" + "\n".join(
        f"Rule {i}: answer questions about place number {i} briefly and name one real example." for i in range(rules)
    )


def conversation(tag: str, depth: int, rules: int) -> list[dict]:
    messages = [{"role": "system", "content": system(tag, rules)}]
    for turn in range(depth):
        messages.append({"role": "user", "content": f"{QUESTIONS[turn % len(QUESTIONS)]} (turn {turn + 1})"})
        messages.append({"role": "assistant", "content": f"Here is answer {turn + 1}: a well known example."})
    return messages


def flood(server: Server, n: int, rules: int) -> None:
    for i in range(n):
        tag = f"flood-{i}-{time.time()}"
        chat_ttft(server, conversation(tag, 2, rules) + [{"role": "user", "content": "Go on."}], max_tokens=2)


def run_variant(server: Server, variant: str, depths: list[int], rules: int, flood_n: int) -> dict:
    out = {}
    for depth in depths:
        history = conversation(f"{variant}-{depth}-{time.time()}", depth, rules)
        chat_ttft(server, history + [{"role": "user", "content": "First question?"}], max_tokens=2)
        if variant == "pinned":
            r = httpx.post(
                f"{server.url}/v1/cache/pin", json={"messages": history, "add_generation_prompt": False}, timeout=600
            )
            r.raise_for_status()
        flood(server, flood_n, rules)
        t, _, cached = chat_ttft(server, history + [{"role": "user", "content": "Next question?"}], max_tokens=4)
        out[depth] = {"ttft_s": t, "cached_tokens": cached}
        print(variant, depth, out[depth], flush=True)
        if variant == "pinned":
            httpx.post(
                f"{server.url}/v1/cache/unpin", json={"messages": history, "add_generation_prompt": False}, timeout=60
            )
    return out


# Budgets the flood overflows many times: ~0.7k tokens of RAM, ~1.4k tokens of SSD (SmolLM2: 46 KB/token).
BUDGETS_TOML = (
    '[cache]\nram_max_bytes = "40MiB"\npinned_ram_share = 0.9\n[ssd]\nmax_bytes = "64MiB"\nmin_free_bytes = 0\n'
)


VARIANTS = [("pinned", "mlx-kvserve"), ("unpinned", "mlx-kvserve"), ("mlx_lm.server", "mlx_lm.server")]


def run_pins(model_dir: Path, env: dict[str, str], depths: list[int], rules: int, flood_n: int) -> dict:
    """All three variants, each on a fresh server (ours with the small budgets): the results dict."""
    home = Path(tempfile.mkdtemp(prefix="kvserve-pins-"))
    config = home / "budgets.toml"
    config.write_text(BUDGETS_TOML)
    results: dict = {"depths": depths, "flood_conversations": flood_n, "rules": rules}
    for variant, kind in VARIANTS:
        if kind == "mlx-kvserve":
            server = kvserve_server(model_dir, env, home / variant, "--config", str(config))
        else:
            port = free_port()
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
            server = Server(kind, cmd, port, env, "/v1/models")
        try:
            server.wait(server.ready_path)
            chat_ttft(server, [{"role": "user", "content": "warm up"}], 2)
            results[variant] = run_variant(server, variant, depths, rules, flood_n)
        finally:
            server.stop()
    return results


def report_lines(results: dict) -> list[str]:
    lines = [
        "| depth | pinned TTFT s (cached) | unpinned TTFT s (cached) | mlx_lm.server TTFT s | unpinned / pinned |",
        "|---|---|---|---|---|",
    ]
    for d in results["depths"]:
        p, u, m = results["pinned"][d], results["unpinned"][d], results["mlx_lm.server"][d]
        lines.append(
            f"| {d} | {p['ttft_s']:.3f} ({p['cached_tokens']}) | {u['ttft_s']:.3f} ({u['cached_tokens']}) | "
            f"{m['ttft_s']:.3f} | {u['ttft_s'] / p['ttft_s']:.1f}x |"
        )
    return lines
