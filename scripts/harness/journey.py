"""journeys.py hybrid-restart's journey, which tests/server/test_hybrid_restart.py runs on its own tiny models: a
system prompt + question asked cold, again, another question; SIGTERM; a new `mlx-kvserve run` process on
the same home folder; the first question again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import httpx

from harness.servers import Server, kvserve_server

QUESTIONS = ("Which town is on river 3?", "And which one is on river 9?")


def system_prompt() -> str:
    """848 tokens with SmolLM2's chat template: the user's message starts 16 tokens into a block, so
    both questions' checkpoints (their message starts, one short of the prompt's end, the reply's
    end) are tails of one block, more than its per-parent limit."""
    return " ".join(f"Rule {i}: answer questions about river {i} with the town {i * 7}, briefly." for i in range(40))


class Reply(NamedTuple):
    text: str
    prompt_tokens: int
    cached_tokens: int


class Journey(NamedTuple):
    cold: Reply
    again: Reply
    other: Reply
    restarted: Reply
    shutdown_rc: int
    ssd_files: dict[str, int]  # after the clean shutdown: "blocks", "tails"

    @property
    def same_reply(self) -> bool:
        return self.restarted.text == self.cold.text

    @property
    def ok(self) -> bool:
        """A clean stop; after it the system prompt is still cached (as the other question found it)
        and the greedy reply is the cold one."""
        hit = self.restarted.cached_tokens >= max(1, self.other.cached_tokens)
        return self.shutdown_rc == 0 and hit and self.same_reply


def start_server(model: Path, home: Path) -> Server:
    """`mlx-kvserve run` as a child process with its own home folder (so its own cache folders), ready."""
    server = kvserve_server(model, dict(os.environ, PYTHONUNBUFFERED="1"), home)
    server.wait("/health", timeout=180)
    return server


def chat(server: Server, system: str, question: str, max_tokens: int = 12) -> Reply:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Reply(out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"], cached)


def stop(server: Server) -> int:
    """SIGTERM, as a service manager or Ctrl-C would; the exit status (-9: killed after 60 s)."""
    server.stop()
    return server.proc.wait()


def ssd_files(home: Path) -> dict[str, int]:
    files = [p for p in (home / "kv").rglob("*") if p.is_file()]
    tails = [p for p in files if "tails" in p.parts]
    blocks = [p for p in files if p.suffix == ".safetensors" and "tails" not in p.parts]
    return {"blocks": len(blocks), "tails": len(tails)}


def run_journey(model: Path, home: Path, system: str = "", questions: tuple[str, str] = QUESTIONS) -> Journey:
    """Cold, again, another question under the same system prompt (default: system_prompt());
    SIGTERM; a new process on the same home folder; the first question again."""
    system = system or system_prompt()
    server = start_server(model, home)
    try:
        cold, again = chat(server, system, questions[0]), chat(server, system, questions[0])
        other = chat(server, system, questions[1])
    finally:
        rc = stop(server)
    files = ssd_files(home)
    server = start_server(model, home)
    try:
        restarted = chat(server, system, questions[0])
    finally:
        server.stop()
    return Journey(cold, again, other, restarted, rc, files)
