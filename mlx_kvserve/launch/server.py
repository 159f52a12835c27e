"""A server started for a launched client: `mlx-kvserve run` in the background, its output in a log
file, waited for until /health answers, and stopped when the client is done."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import KVServeError
from .target import Target, probe


class StartedServer:
    """`mlx-kvserve run ARGS` (or `program` ARGS: tests) in its own session (the terminal's Ctrl-C reaches the client, not the
    server), writing to `log_path`. `wait` raises KVServeError when it exits or is not up in time."""

    def __init__(self, run_args: list[str], log_path: Path, program: tuple[str, ...] = ()):
        log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path = log_path
        self.argv = [*(program or (sys.executable, "-m", "mlx_kvserve", "run")), *run_args]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def wait(
        self, url: str, api_key: str, timeout_s: float, progress: Callable[[str], None], poll_s: float = 0.5
    ) -> Target:
        """The server once /health answers at `url` (a first run downloads and converts the model)."""
        deadline, told = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KVServeError(f"the server exited with code {self.proc.returncode}: see {self.log_path}")
            target = probe(url, api_key)
            if target is not None:
                return target
            if time.monotonic() - told > 15:
                progress(f"still starting (a first run downloads the model); log: {self.log_path}")
                told = time.monotonic()
            time.sleep(poll_s)
        self.stop()
        raise KVServeError(f"the server did not answer at {url} within {timeout_s:.0f}s: see {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the server drains and saves its cache), then SIGKILL past `timeout_s`."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
