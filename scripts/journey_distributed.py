"""A user's distributed run of the default model on one machine, end to end (issue 23, first step 2).

What docs/distributed.md says to run, with two ranks on loopback (`mlx.launch -n 2 --backend ring
-- mlx-kvserve run --distributed …`), SmolLM2-135M (9 attention heads, 3 KV heads, 30 layers):

1. one process (`mlx-kvserve run`): a greedy chat reply, the reference;
2. `--distributed tensor`: must be refused at startup (9 heads do not split in two), saying why;
3. `--distributed pipeline`: the same chat gives the same reply, and again a cache hit;
4. the launcher stopped (SIGTERM, as `kill` does) and launched again at once: the new ranks start
   (no cache folder or port still held by the old ones) and the chat hits the SSD cache;
5. Ctrl-C (SIGINT to the launcher's process group): every rank exits.

    .venv/bin/python scripts/journey_distributed.py

Every server gets a config in a temporary folder (its own SSD folder and port) that reads the
default model from the user's model cache (converted there once by `mlx-kvserve run`). Prints
each step; exits 1 when one fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from harness.servers import free_port

BIN = Path(sys.executable).parent
CHAT = [{"role": "user", "content": "Name three rivers of Europe and one town on each."}]
START_TIMEOUT_S = 240
EXIT_TIMEOUT_S = 30


class Reply(NamedTuple):
    text: str
    cached_tokens: int


def write_config(folder: Path, name: str, port: int) -> Path:
    from mlx_kvserve.config import default_home

    path = folder / f"{name}.toml"
    path.write_text(
        f'[model]\nmodels_dir = "{default_home() / "models"}"\n'
        f'[ssd]\ncache_dir = "{folder / name / "kv"}"\n'
        f"[server]\nport = {port}\n"
    )
    return path


def start(command: list[str], log: Path) -> subprocess.Popen:
    """In a session of its own, as in a terminal: Ctrl-C reaches the whole process group."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not ready after {START_TIMEOUT_S} s:\n{tail(log)}")


def chat(port: int) -> Reply:
    body = {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": 32, "temperature": 0}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    data = response.json()
    details = data["usage"].get("prompt_tokens_details") or {}
    return Reply(data["choices"][0]["message"]["content"], details.get("cached_tokens", 0))


def ranks_of(launcher: subprocess.Popen) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def seconds_until_gone(pids: list[int], launcher: subprocess.Popen | None = None) -> float | None:
    """How long until none of `pids` (nor `launcher`) runs; None: still running after EXIT_TIMEOUT_S."""
    began = time.monotonic()
    while time.monotonic() - began < EXIT_TIMEOUT_S:
        if (launcher is None or launcher.poll() is not None) and not any(map(is_running, pids)):
            return time.monotonic() - began
        time.sleep(0.1)
    return None


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # whatever is left of its session (lingering ranks)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Journey:
    def __init__(self, home: Path):
        self.home = home
        self.log = home / "servers.log"
        self.failures: list[str] = []
        self.started: list[subprocess.Popen] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failures.append(what)

    def launch(self, config: Path, mode: str) -> subprocess.Popen:
        run = [str(BIN / "mlx-kvserve"), "run", "--config", str(config), "--distributed", mode]
        proc = start([str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--", *run], self.log)
        self.started.append(proc)
        return proc

    def one_process(self) -> Reply:
        print("1. one process: mlx-kvserve run")
        port = free_port()
        single = start(
            [str(BIN / "mlx-kvserve"), "run", "--config", str(write_config(self.home, "single", port))], self.log
        )
        try:
            wait_ready(single, port, self.log)
            reference = chat(port)
        finally:
            stop(single)
        print(f"  reply: {reference.text!r}")
        return reference

    def tensor_refused(self) -> None:
        print("2. mlx.launch -n 2 --backend ring -- mlx-kvserve run --distributed tensor")
        tensor = self.launch(write_config(self.home, "tensor", free_port()), "tensor")
        try:
            tensor.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        exited = tensor.poll() is not None
        refusal = next((line for line in tail(self.log, 40).splitlines() if "cannot split" in line), "")
        print(f"  {refusal.strip()}")
        self.check(exited and "cannot split" in refusal, "refused at startup, saying why")

    def pipeline(self, reference: Reply) -> None:
        print("3. mlx.launch -n 2 --backend ring -- mlx-kvserve run --distributed pipeline")
        port = free_port()
        config = write_config(self.home, "pipeline", port)
        first = self.launch(config, "pipeline")
        wait_ready(first, port, self.log)
        cold, again = chat(port), chat(port)
        print(f"  reply: {cold.text!r}")
        self.check(cold.text == reference.text, "the same greedy reply as one process")
        self.check(
            again.text == reference.text and again.cached_tokens > 0, f"again: cached_tokens {again.cached_tokens}"
        )

        print("4. kill <launcher> (SIGTERM), then the same launch at once")
        old_ranks = ranks_of(first)
        first.send_signal(signal.SIGTERM)
        second = self.launch(config, "pipeline")
        gone = seconds_until_gone(old_ranks)
        self.check(gone is not None, f"the old ranks exited ({gone:.1f} s)" if gone is not None else "old ranks linger")
        wait_ready(second, port, self.log)
        restarted = chat(port)
        self.check(
            restarted.text == reference.text and restarted.cached_tokens > 0,
            f"relaunched: the same reply, cached_tokens {restarted.cached_tokens} (from the SSD)",
        )

        print("5. Ctrl-C (SIGINT to the launcher's process group)")
        ranks = ranks_of(second)
        os.killpg(second.pid, signal.SIGINT)
        gone = seconds_until_gone(ranks, second)
        self.check(
            gone is not None, f"launcher and ranks exited ({gone:.1f} s)" if gone is not None else "still running"
        )


def main() -> int:
    journey = Journey(Path(tempfile.mkdtemp(prefix="journey-distributed-")))
    print(f"logs: {journey.log}")
    try:
        reference = journey.one_process()
        journey.tensor_refused()
        journey.pipeline(reference)
    except (RuntimeError, httpx.HTTPError) as exc:
        journey.check(False, str(exc))
    finally:
        for proc in journey.started:
            stop(proc, signal.SIGKILL)
    failures = journey.failures
    print("ok" if not failures else f"{len(failures)} failed; logs: {journey.log}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
