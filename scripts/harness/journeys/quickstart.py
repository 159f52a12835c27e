"""The docs' quick starts, run as a user runs them (issue 23, first steps): the commands are the docs'
own lines, executed by a shell, in a scratch home folder (MLX_KVSERVE_HOME) that reuses the converted
default model of the real one, so nothing of the user's cache is touched.

1. README: `mlx-kvserve run` (what `make run` starts) on the default model, then the README's curl
   and its Python snippet; the same question again must be a cache hit; the dashboard it prints
   (/ui, and GET / pointing to it) and `mlx-kvserve cache stats` (with `--url … --json` after the command).
2. docs/router.md: two servers on one machine with the default config (`--port 8001 &`,
   `--port 8002 &`), the router, and the docs' curl through it; then the same prompt sent to each
   backend directly: whichever did not compute it serves it from the SSD blocks the other wrote
   (they share one cache folder: the first owns it, the second is its guest).

    .venv/bin/python scripts/journeys.py quickstart [--only readme|router] [--keep]

Prints each step and exits 1 at the first that fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: mlx-kvserve, python
README_CURL = """curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}'"""
README_PY = """from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi!"}])
print(reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens)"""
ROUTER_CURL = """curl -s http://127.0.0.1:8100/v1/chat/completions -H 'x-session-id: alice' \\
     -d '{"messages": [{"role": "user", "content": "Hello"}]}'"""
LONG_SYSTEM = " ".join(f"Fact {i}: the lighthouse number {i} is painted in colour {i % 7}." for i in range(60))


class JourneyFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
    if not ok:
        raise JourneyFailed(what)


def scratch_home(tmp: Path) -> dict[str, str]:
    """An environment whose home folder is new but holds the real home's converted models."""
    home = tmp / "home"
    home.mkdir(mode=0o700)
    real = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-kvserve" / "models"
    if real.is_dir():
        (home / "models").symlink_to(real)
    return dict(os.environ, MLX_KVSERVE_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")


def start(command: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    print(f"$ {command}", flush=True)
    # A session of its own: `cmd &` leaves the server behind its shell, in the same process group.
    return subprocess.Popen(
        command, shell=True, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_healthy(url: str, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{url}/health", timeout=5)
            if reply.status_code == 200:
                return reply.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise JourneyFailed(f"{url} did not become healthy in {timeout_s:.0f} s")


def shell(command: str, env: dict[str, str]) -> str:
    print(f"$ {command}", flush=True)
    done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=600)
    check(done.returncode == 0, f"exit status 0 (got {done.returncode}: {done.stderr.strip()[-300:]})")
    return done.stdout


def stop(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """SIGTERM to each command's process group (its server included), then wait until it is gone."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def chat(url: str, system: str, question: str) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    body.update(temperature=0, max_tokens=16)
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    check(reply.status_code == 200, f"POST {url}/v1/chat/completions: {reply.status_code}")
    return reply.json()


def writer_idle(url: str, timeout_s: float = 60.0) -> bool:
    """Whether the server's SSD writer has nothing queued or in flight (writes are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cache = httpx.get(f"{url}/health", timeout=5).json()["cache"]
        if cache.get("writer_queue_depth") == 0 and cache.get("writer_pending") == 0:
            return True
        time.sleep(0.2)
    return False


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def readme_journey(env: dict[str, str], logs: Path) -> None:
    print("== README: mlx-kvserve run (make run) + the README's curl and Python", flush=True)
    server = start("mlx-kvserve run --model default", env, logs / "readme-server.log")
    try:
        wait_healthy("http://127.0.0.1:8000")
        first = json.loads(shell(README_CURL, env))
        check(bool(first["choices"][0]["message"]["content"]), "the curl gets an answer")
        again = json.loads(shell(README_CURL, env))
        check(again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"], "same answer")
        check(cached(again) > 0, f"the repeat is a cache hit ({cached(again)} of {again['usage']['prompt_tokens']})")
        out = shell(f"{sys.executable} -c '{README_PY}'", env)
        check(out.strip().split()[-1].isdigit(), f"the Python snippet prints a reply and its cached tokens: {out!r}")
        dashboard_journey(env, logs / "readme-server.log")
    finally:
        stop([server])


def dashboard_journey(env: dict[str, str], server_log: Path) -> None:
    """README's "Use it": the dashboard the start prints, GET / pointing to it, and the cache commands."""
    check("dashboard: http://127.0.0.1:8000/ui" in server_log.read_text(), "the start prints the dashboard's address")
    page = httpx.get("http://127.0.0.1:8000/ui", timeout=10)
    check(page.status_code == 200 and "text/html" in page.headers["content-type"], "GET /ui is the dashboard")
    check(httpx.get("http://127.0.0.1:8000/", timeout=10).json().get("dashboard") == "/ui", "GET / points to /ui")
    summary = shell("mlx-kvserve cache stats", env)
    check("cache hits: " in summary and "RAM: " in summary, f"cache stats is a short summary: {summary!r}")
    raw = json.loads(shell("mlx-kvserve cache stats --url http://127.0.0.1:8000 --json", env))
    check(raw.get("kv_lookups", 0) >= 3, "cache stats --url … --json: the raw counters, options after the command")


def router_journey(env: dict[str, str], logs: Path) -> None:
    print("== docs/router.md quick start: two servers on one machine, one router", flush=True)
    procs = [start("mlx-kvserve run --port 8001 &", env, logs / "server-8001.log")]
    # `cmd &` in its own shell returns at once: the servers are found by their ports.
    procs.append(start("mlx-kvserve run --port 8002 &", env, logs / "server-8002.log"))
    router = None
    try:
        a, b = wait_healthy("http://127.0.0.1:8001"), wait_healthy("http://127.0.0.1:8002")
        roles = sorted([a["cache"].get("ssd_role"), b["cache"].get("ssd_role")])
        check(roles == ["guest", "owner"], f"both servers run on one cache folder: roles {roles}")
        backends = "--backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002"
        router = start(f"mlx-kvserve router {backends}", env, logs / "router.log")
        wait_healthy("http://127.0.0.1:8100")
        reply = json.loads(shell(ROUTER_CURL, env))
        check(bool(reply.get("choices")), "the docs' curl through the router gets an answer")
        first = chat("http://127.0.0.1:8001", LONG_SYSTEM, "Which colour is lighthouse 12?")
        check(writer_idle("http://127.0.0.1:8001"), "8001 wrote its blocks to the SSD")
        other = chat("http://127.0.0.1:8002", LONG_SYSTEM, "Which colour is lighthouse 12?")
        tokens = first["usage"]["prompt_tokens"]
        check(cached(first) < tokens // 4, f"8001 computes the long prompt ({cached(first)} of {tokens} cached)")
        same = other["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        check(same, "8002 gives the same greedy answer")
        served = f"8002 serves it from the blocks 8001 wrote: {cached(other)} of {tokens} tokens cached"
        check(cached(other) >= tokens * 3 // 4, served)
    finally:
        stop(([router] if router else []) + procs)


def ports_free(ports: tuple[int, ...]) -> bool:
    """The docs' ports must be free: a server already there would answer in place of the journey's."""
    import socket

    busy = []
    for port in ports:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    if busy:
        print(f"ports {busy} are in use: stop what listens there first", flush=True)
    return not busy


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", choices=("readme", "router"))
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder and the logs")


def run(args: argparse.Namespace) -> int:
    if not ports_free((8000, 8001, 8002, 8100)):
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-journey-"))
    env = scratch_home(tmp)
    try:
        if args.only in (None, "readme"):
            readme_journey(env, tmp)
        if args.only in (None, "router"):
            router_journey(env, tmp)
    except JourneyFailed as exc:
        print(f"journey failed: {exc} (logs in {tmp})", flush=True)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("every step worked", flush=True)
    return 0
