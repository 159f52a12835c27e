"""The ranks of a distributed server leave when `mlx.launch` is stopped (rank_exit.py): mlx.launch
forwards no signal, so a killed launcher used to leave its ranks running, holding the port and
the cache folders, and the next launch failed. Tested on a real two-rank server (a launch right
after `kill <launcher>` serves, with the old ranks gone; Ctrl-C stops every rank), and the two
mechanisms alone: the parent watch and the hard exit of a rank stuck in a collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from tinymodel import build_mlx_model

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True, **kwargs)


def test_a_stopping_rank_stuck_in_a_collective_exits_within_its_grace():
    stuck = _python(
        "import threading\n"
        "from mlx_kvserve.rank_exit import RankExit\n"
        "RankExit(1, grace_s=0.5).deadline('SIGTERM')\n"
        "threading.Event().wait()  # a collective whose peer hung\n",
        stderr=subprocess.PIPE,
    )
    began = time.monotonic()
    _, err = stuck.communicate(timeout=30)
    assert stuck.returncode == 1 and time.monotonic() - began < 20
    assert "SIGTERM: stopping" in err and "still running 0 s after SIGTERM" in err


def test_a_rank_sees_its_launcher_go(tmp_path):
    """A "launcher" starts a "rank" and dies without a word, as mlx.launch does when killed."""
    marker, watching = tmp_path / "gone", tmp_path / "watching"
    rank = (
        "import os, time\n"
        "from mlx_kvserve.rank_exit import RankExit\n"
        "parent = os.getppid()\n"
        f"RankExit(1, grace_s=60).watch_parent(lambda: (open({str(marker)!r}, 'w').close(), os._exit(0)), parent)\n"
        f"open({str(watching)!r}, 'w').close()\n"
        "time.sleep(30)\n"
    )
    launcher = _python(
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
        f"while not os.path.exists({str(watching)!r}):\n"
        "    time.sleep(0.05)\n",
        stdout=subprocess.DEVNULL,
    )
    launcher.wait(30)
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()


class Launch:
    """`mlx.launch -n 2 --backend ring -- mlx-kvserve run --distributed pipeline`, in a session of
    its own (as in a terminal: Ctrl-C reaches the launcher and every rank)."""

    def __init__(self, model: Path, home: Path, port: int):
        run = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model), "--port", str(port)]
        launcher = Path(sys.executable).with_name("mlx.launch")
        cmd = [str(launcher), "-n", "2", "--backend", "ring", "--", *run, "--distributed", "pipeline"]
        env = {**os.environ, "MLX_KVSERVE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        self.log = home / f"launch-{time.monotonic_ns()}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the launch ended ({self.proc.returncode}):\n{self.log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log.read_text())

    def ranks(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def chat(self) -> tuple[str, int]:
        name = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": name,
            "messages": [{"role": "user", "content": "the river"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        reply = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120).json()
        return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(pids)


@pytest.mark.slow
def test_a_launch_right_after_the_launcher_is_killed_serves_and_ctrl_c_stops_every_rank(tmp_path):
    shape = {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48, "num_hidden_layers": 3}
    model = build_mlx_model(tmp_path / "llama", **shape)
    home, port = tmp_path / "home", free_port()
    home.mkdir()
    first = Launch(model, home, port)
    launches = [first]
    try:
        first.wait_ready()
        text, _ = first.chat()
        old_ranks = first.ranks()
        assert len(old_ranks) == 2
        first.proc.send_signal(signal.SIGTERM)  # `kill <launcher>`: it dies at once, forwarding nothing
        second = Launch(model, home, port)  # at once, on the same port and cache folders
        launches.append(second)
        assert _wait_gone(old_ranks, 30) == [], "the killed launcher's ranks run on"
        second.wait_ready()
        again, cached = second.chat()
        assert again == text and cached > 0  # a hit from the SSD folders the old ranks left
        ranks = second.ranks()
        os.killpg(second.proc.pid, signal.SIGINT)  # Ctrl-C
        second.proc.wait(120)  # generous: a loaded 2-core machine
        assert _wait_gone(ranks, 30) == []
    finally:
        for launch in launches:
            launch.kill()
