"""A user's restart of a hybrid model, end to end (issue 23, first step 1).

Builds a tiny random-weight model of an mlx-lm family (mlx_kvserve.models.synthetic.FAMILY_CONFIGS)
with SmolLM2's tokenizer, then does what a user does: `mlx-kvserve run` as a process, an 848-token
system prompt + question asked cold, the same again, another question under the same system prompt;
SIGTERM and wait for the exit; a new process on the same home folder; the first question again.
Prints each reply's cached tokens and whether the reply after the restart equals the cold one.

    .venv/bin/python scripts/journey_hybrid_restart.py [family ...]   (default: qwen3_5 nemotron_h lfm2)

Exits 1 when the restarted server misses what the first one held for the system prompt (the cached
tokens of the other question) or its greedy reply differs from the cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

ROOT = Path(__file__).resolve().parents[1]
SMOLLM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
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


def build_model(folder: Path, family: str, tokenizer_dir: Path) -> Path:
    """A tiny random `family` model whose vocabulary and tokenizer are SmolLM2's (copied from
    `tokenizer_dir`, the default model's folder)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_kvserve.models.synthetic import family_config, random_model

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = family_config(family, vocab_size=vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in SMOLLM_TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(random_model(config).parameters())))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlx-kvserve run` as a child process with its own home folder (so its own cache folders)."""

    def __init__(self, model: Path, home: Path, timeout_s: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / f"server-{self.port}.log"
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model), "--port", str(self.port)]
        env = dict(os.environ, MLX_KVSERVE_HOME=str(home), PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()}")
            time.sleep(0.2)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"]

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def chat(self, system: str, question: str, max_tokens: int = 12) -> Reply:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        out = r.json()
        usage = out["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Reply(out["choices"][0]["message"]["content"], usage["prompt_tokens"], cached)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as a service manager or Ctrl-C would, and wait for the exit."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def log(self) -> str:
        return self.log_path.read_text()


def ssd_files(home: Path) -> dict[str, int]:
    files = [p for p in (home / "kv").rglob("*") if p.is_file()]
    tails = [p for p in files if "tails" in p.parts]
    blocks = [p for p in files if p.suffix == ".safetensors" and "tails" not in p.parts]
    return {"blocks": len(blocks), "tails": len(tails)}


def run_journey(model: Path, home: Path, system: str = "", questions: tuple[str, str] = QUESTIONS) -> Journey:
    """Cold, again, another question under the same system prompt (default: system_prompt());
    SIGTERM; a new process on the same home folder; the first question again."""
    system = system or system_prompt()
    server = Server(model, home)
    try:
        cold, again = server.chat(system, questions[0]), server.chat(system, questions[0])
        other = server.chat(system, questions[1])
    finally:
        rc = server.stop()
    files = ssd_files(home)
    server = Server(model, home)
    try:
        restarted = server.chat(system, questions[0])
    finally:
        server.stop()
    return Journey(cold, again, other, restarted, rc, files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=["qwen3_5", "nemotron_h", "lfm2"])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders (models, homes, logs)")
    args = parser.parse_args()

    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.default import ensure_default_model

    smollm = ensure_default_model(default_home() / "models", "float32")
    work = Path(tempfile.mkdtemp(prefix="journey-hybrid-"))
    failed = []
    for family in args.families:
        model = build_model(work / family / "model", family, smollm)
        journey = run_journey(model, work / family / "home")
        print(f"== {family}: prompt {journey.cold.prompt_tokens} tokens")
        for name in ("cold", "again", "other", "restarted"):
            reply = getattr(journey, name)
            print(f"  {name:<10} cached {reply.cached_tokens:>4}  {reply.text!r}")
        print(f"  SIGTERM exit {journey.shutdown_rc}; on disk after it: {journey.ssd_files}")
        verdict = "OK" if journey.ok else "FAILED"
        print(f"  {verdict}: restarted reply {'==' if journey.same_reply else '!='} cold reply")
        if not journey.ok:
            failed.append(family)
    if args.keep or failed:
        print(f"folders kept in {work}")
    else:
        shutil.rmtree(work)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
