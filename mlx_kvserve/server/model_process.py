"""A model served by a process of its own (`[[models]] process = true`; docs/models.md "Threads and
fairness"): another `mlx-kvserve run` on a loopback port, serving that one model with the server's
config, which this server starts as the model's load and stops as its unload.

Why: MLX caps the operations in flight per process, so within one process a large model's prefill holds
back a small model's first token (docs/models.md). A process has its own scheduler, its own cap and its
own BLAS threads; the OS shares the machine between them.

Contract:
- `ModelProcess.start(entry, config)` spawns the child and returns once it serves (its /health answers and
  its model is loaded), as `engine/model_load.Loaded`; ModelLoadError with the child's last log lines
  when it exits first or does not serve within `start_timeout_s`.
- The child listens on 127.0.0.1 only and takes a random key this process sends (server/model_proxy.py
  forwards the requests); it leaves when this process is gone (MLX_KVSERVE_PARENT_PID, cli.py), so
  neither a crash nor kill -9 here leaves it holding its port and its cache folder's lock.
- A child that dies (a crash, kill -9, out of memory) is started again by the watch thread; requests that
  arrive meanwhile wait for it (`ready`). Its KV cache survives on the SSD, as after any restart. /health
  stays "ok" meanwhile (the other models serve); the model's row says `process.serving` false.
- The facts the server reads from an engine (`health`, `batch_stats`, `cache_stats`, `is_alive`, ...)
  come from the child's /health, polled every POLL_S on the watch thread: nothing here blocks on it.
- `stop(timeout)` ends the child the way a service manager does (SIGTERM: its requests finish, its SSD
  writer drains, its lock goes), SIGKILL after `timeout` plus the drain bound.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ..config import Config
from ..errors import ModelLoadError
from ..model_entries import ModelEntry
from ..registry.load import Loaded
from .gate import PRINCIPAL_HEADER_ENV
from .model_config import child_config_text

log = logging.getLogger(__name__)

PARENT_PID_ENV = "MLX_KVSERVE_PARENT_PID"
POLL_S = 1.0
START_TIMEOUT_S = 600.0
LOG_LINES = 40  # the child's last log lines, for a failed start's error
# The environment's keys would replace the child's own key (cli.py reads them over the config file).
KEY_ENVS = ("MLX_KVSERVE_API_KEY", "MLX_KVSERVE_ADMIN_API_KEY", "MLX_KVSERVE_API_KEY_FILE")
KEY_ENVS += ("MLX_KVSERVE_ADMIN_API_KEY_FILE",)


def free_loopback_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ModelProcess:
    """One model's child server (see the module docstring). Looks like an Engine to the registry and
    the health routes; requests reach it through `server/model_proxy.py`."""

    def __init__(self, entry: ModelEntry, config: Config, start_timeout_s: float = START_TIMEOUT_S):
        self.entry, self.config, self.start_timeout_s = entry, config, start_timeout_s
        self.key = secrets.token_urlsafe(24)
        self.model_name = entry.name
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.starts = 0  # processes started (1 + restarts)
        self._folder = Path(tempfile.mkdtemp(prefix=f"mlx-kvserve-{entry.name[:20].replace('/', '_')}-"))
        self._log_tail: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._health: dict[str, Any] = {}
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        # One client for every call here: a new one per call costs 40-60 ms of CPU under the GIL (its
        # TLS context), which the models served in this process would pay at every poll. Loopback
        # only: no TLS, and no proxy from the environment.
        self.http = httpx.Client(verify=False, trust_env=False)

    @classmethod
    def start(cls, entry: ModelEntry, config: Config) -> Loaded:
        """The child started and serving, with its weights' size from its /v1/models."""
        child = cls(entry, config)
        try:
            child.spawn()
        except ModelLoadError:
            child.stop(0)  # its folder (the config with the key) and its client go with it
            raise
        child._watch = threading.Thread(target=child._watch_loop, name=f"model-process-{entry.name}", daemon=True)
        child._watch.start()
        row = next(iter(child.get("/v1/cache/models").get("models", [])), {})
        return Loaded(child, int(row.get("weights_bytes") or 0))

    # --- the child's life -----------------------------------------------------------------------

    def spawn(self) -> None:
        """Start a child and wait until it serves; ModelLoadError when it cannot."""
        logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per /health poll
        self._ready.clear()
        self.port = free_loopback_port()
        config_path = self._folder / "config.toml"
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the key
        with os.fdopen(fd, "w") as f:
            f.write(child_config_text(self.config, self.entry, self.port, self.key))
        env = {k: v for k, v in os.environ.items() if k not in KEY_ENVS}
        env |= {PARENT_PID_ENV: str(os.getpid()), PRINCIPAL_HEADER_ENV: "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--config", str(config_path)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.starts += 1
        threading.Thread(target=self._read_log, args=(self.proc,), name="model-process-log", daemon=True).start()
        log.info("model %s: process %d starting on port %d", self.entry.name, self.proc.pid, self.port)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ModelLoadError(self._failed(f"its process exited with {self.proc.returncode}"))
            if self._poll():
                config_path.unlink()  # read at the child's start; it holds the key
                self._ready.set()
                return
            time.sleep(0.1)
        self._end(5.0)
        raise ModelLoadError(self._failed(f"its process did not serve within {self.start_timeout_s:.0f}s"))

    def _failed(self, why: str) -> str:
        time.sleep(0.2)  # the log reader's last lines
        tail = "\n".join(list(self._log_tail)[-12:])
        return f"model {self.entry.name!r} failed to load: {why}:\n{tail}"

    def _read_log(self, proc: subprocess.Popen) -> None:
        child_log = logging.getLogger(f"{__name__}.{self.entry.name}")
        for line in proc.stdout or ():
            line = line.rstrip()
            self._log_tail.append(line)
            child_log.info("%s", line)

    def _watch_loop(self) -> None:
        """Poll the child's /health; start it again when it died."""
        backoff = 1.0
        while not self._stopping.wait(POLL_S):
            proc = self.proc
            if proc is not None and proc.poll() is None:
                self._poll()
                continue
            self._ready.clear()
            self._health = {}
            code = proc.returncode if proc is not None else None
            log.error("model %s: its process exited (%s); starting it again", self.entry.name, code)
            try:
                self.spawn()
                backoff = 1.0
            except ModelLoadError as exc:
                log.error("%s", exc.message)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 60.0)

    def _poll(self) -> bool:
        """Refresh the child's /health; whether it serves."""
        try:
            body = self.get("/health", timeout=2.0)
        except (httpx.HTTPError, ValueError):
            return False
        self._health = body
        return body.get("status") in ("ok", "degraded")

    def get(self, path: str, timeout: float = 10.0) -> dict[str, Any]:
        reply = self.http.get(self.url(path), headers=self.auth_headers(), timeout=timeout)
        reply.raise_for_status()
        return reply.json()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def lost(self, proc: subprocess.Popen | None, wait_s: float = 2.0) -> bool:
        """Whether `proc`, the process a request went to, is gone: replaced by a new one, or exiting
        (waited for up to `wait_s`: a killed process refuses connections a moment before it can be
        reaped). Then `ready` waits for the next one, which the watch thread starts."""
        if proc is None or proc is not self.proc:
            return True
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False  # alive, and failing: the request's error stands
        if proc is self.proc:
            self._ready.clear()
        return True

    def ready(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until the child serves; whether it does."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._ready.clear()
        grace = (self.config.server.shutdown_timeout_s if timeout is None else timeout) + (
            self.config.ssd.drain_timeout_s
        )
        self._end(grace + 10.0)
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(POLL_S + 5.0)
        self.http.close()
        for path in self._folder.glob("*"):
            path.unlink(missing_ok=True)
        self._folder.rmdir()

    def _end(self, grace_s: float) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.error(
                "model %s: process %d still running %.0fs after SIGTERM: killed", self.model_name, proc.pid, grace_s
            )
            proc.kill()
            proc.wait()

    # --- what the server reads of an engine, from the child's last /health --------------------

    @property
    def is_alive(self) -> bool:
        """True until stopped: a child that died is started again (`process_info()["serving"]` says
        whether it serves now), so the server as a whole stays healthy meanwhile."""
        return not self._stopping.is_set()

    failure = ""  # nothing here stops every model from being served (distributed's ranks do)

    def ssd_problem(self) -> str:
        return "; ".join(p for p in self._health.get("problems", []) if "SSD" in p)

    @property
    def queue_depth(self) -> int:
        return int(self._health.get("queue_depth", 0))

    @property
    def is_busy(self) -> bool:
        return bool(self._health.get("busy", False))

    @property
    def context_length(self) -> int:
        return int(self._health.get("context_length", 0))

    def batch_stats(self) -> dict[str, Any]:
        return dict(self._health.get("batch", {}))

    def cache_stats(self) -> dict[str, Any]:
        return dict(self._health.get("cache", {"enabled": False}))

    def health(self) -> dict[str, Any]:
        body = {k: v for k, v in self._health.items() if k not in ("models", "problems", "status")}
        return body | {"status": "ok", "model": self.model_name, "process": self.process_info()}

    def process_info(self) -> dict[str, Any]:
        """This model's process, for /health and /v1/cache/models."""
        serving = self._ready.is_set() and self.proc is not None and self.proc.poll() is None
        return {
            "pid": self.proc.pid if self.proc else None,
            "port": self.port,
            "starts": self.starts,
            "serving": serving,
            "ssd_max_bytes": self.config.ssd.max_bytes,  # the share of ssd.max_bytes lent it (0: no cap)
        }

    def kv_ram_bytes(self) -> int:
        cache = self._health.get("cache", {})
        return int(cache.get("kv_ram_bytes", 0)) + int(cache.get("kv_tail_bytes", 0))

    def ssd_bytes(self) -> int | None:
        rows = self._health.get("models") or []
        return rows[0].get("ssd_bytes") if rows else None

    def ssd_folder(self) -> Path | None:
        """The child's SSD namespace folder, as its /health names it (None: no SSD tier, or not read)."""
        folder = self._health.get("cache", {}).get("ssd_folder")
        return Path(folder) if folder else None

    def pin_files(self, paths: list[str]) -> None:
        """[cache] pin_on_start for a default model in its own process: each file's text pinned as a
        system prompt through the child's /v1/cache/pin (a bad file is logged and skipped)."""
        for path in paths:
            try:
                text = Path(path).expanduser().read_text()
                body = {"messages": [{"role": "system", "content": text}], "add_generation_prompt": False}
                body["shared"] = True  # every principal's (per_key isolation), as in this process
                reply = self.http.post(self.url("/v1/cache/pin"), json=body, headers=self.auth_headers(), timeout=None)
                reply.raise_for_status()
                log.info("pin_on_start: %s pinned in model %s's process", path, self.model_name)
            except (OSError, httpx.HTTPError) as exc:
                log.error("pin_on_start: %s not pinned: %s", path, exc)


def load_entry(entry: ModelEntry, config: Config) -> Loaded:
    """The registry's loader: a process of its own for `process = true`, else an Engine in this one."""
    if entry.process:
        return ModelProcess.start(entry, config)
    from ..registry.load import load_engine

    return load_engine(entry, config)
