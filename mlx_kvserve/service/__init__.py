"""Run the server as a per-user service: a launchd LaunchAgent on macOS, a systemd user unit on Linux.

The pieces shared by both backends live here. Rendering a service file is a pure function of a
ServiceSpec, so either platform's file can be produced (and tested) on any machine; every external
command goes through `run_command`, the one function tests replace.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..config import Config, default_home, load_config
from ..errors import ConfigError
from ..fsmode import open_private, private_mkdir

PLATFORMS = ("macos", "linux")
# Seconds between the last phase of the server's shutdown and the service manager's SIGKILL.
STOP_MARGIN_S = 30
_ENV_PREFIX = "MLX_KVSERVE_"  # the server's own settings travel into the service environment
# Secrets never go into the service file, which other local users may be able to read: install
# writes each into a 0600 key file and the environment names the file (`<variable>_FILE`) instead.
SECRET_ENV = {"MLX_KVSERVE_API_KEY": "api", "MLX_KVSERVE_ADMIN_API_KEY": "admin"}


@dataclass(frozen=True)
class KeyFile:
    """A key from the install environment, kept in `path` (mode 0600) for the service to read."""

    variable: str  # where the key came from, e.g. MLX_KVSERVE_API_KEY
    path: Path
    key: str = field(repr=False)

    @property
    def file_variable(self) -> str:
        """The variable that names the file in the service environment (the server reads it)."""
        return f"{self.variable}_FILE"


@dataclass(frozen=True)
class ServiceSpec:
    """Everything a service file says, independent of the service manager."""

    label: str  # launchd Label / systemd unit name (without .service)
    program_args: tuple[str, ...]  # absolute interpreter first
    env: tuple[tuple[str, str], ...]  # (name, value) pairs, in order
    working_dir: Path
    log_path: Path  # stdout and stderr both append here
    stop_timeout_s: int  # SIGTERM to SIGKILL
    description: str = "mlx-kvserve: local OpenAI-compatible LLM server"
    key_files: tuple[KeyFile, ...] = ()  # written by install before the service file


class Step(NamedTuple):
    """One external command of an install or uninstall, and whether its failure is expected."""

    args: list[str]
    may_fail: bool = False  # e.g. unloading a service that was never loaded


def current_platform() -> str:
    """'macos' or 'linux'; anything else has no service backend."""
    if sys.platform == "darwin":
        return "macos"
    if sys.platform.startswith("linux"):
        return "linux"
    return sys.platform


def writer_drain_s(config: Config) -> float:
    """Longest time the SSD writer may take to flush on shutdown (`ssd.drain_timeout_s`); nothing
    when the SSD tier is off."""
    return config.ssd.drain_timeout_s if config.ssd.enabled else 0.0


def stop_timeout_s(shutdown_timeout_s: float, drain_s: float, margin_s: float = STOP_MARGIN_S) -> int:
    """Seconds the service manager must wait after SIGTERM before it kills the server.

    Shutdown has two phases, each bounded by `shutdown_timeout_s`: uvicorn lets in-flight requests
    finish, then the lifespan joins the worker thread. The SSD writer's drain follows; the margin
    covers interpreter teardown. Killing the server earlier would lose KV blocks not yet on disk.
    """
    return math.ceil(2 * shutdown_timeout_s + drain_s + margin_s)


def server_args(config_path: Path | None, model: str | None, port: int | None) -> list[str]:
    """`python -m mlx_kvserve run ...` with every path made absolute: a service has no useful cwd.
    A model that is not an existing path is a hub id or "default" and passes through unchanged."""
    args = [os.path.abspath(sys.executable), "-m", "mlx_kvserve", "run"]
    if config_path is not None:
        args += ["--config", str(Path(config_path).expanduser().resolve())]
    if model is not None:
        local = Path(model).expanduser()
        args += ["--model", str(local.resolve()) if local.exists() else model]
    if port is not None:
        args += ["--port", str(port)]
    return args


def key_folder(home: Path) -> Path:
    """Where install keeps key files: the user's config folder (the server's home is a cache)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "mlx-kvserve"


def key_path(folder: Path, label: str, variable: str) -> Path:
    """The file for the key in `variable` of the service `label`: `<label>.api.key` or `<label>.admin.key`."""
    return folder / f"{label}.{SECRET_ENV[variable]}.key"


def key_files(environ: Mapping[str, str], label: str, folder: Path) -> tuple[KeyFile, ...]:
    """The key files for the secrets set in `environ`. Raises ConfigError when a key and its key
    file variable are both set, as the server would."""
    out = []
    for variable in SECRET_ENV:
        if environ.get(variable) and environ.get(f"{variable}_FILE"):
            raise ConfigError(f"set ${variable} or ${variable}_FILE, not both")
        if environ.get(variable):
            out.append(KeyFile(variable, key_path(folder, label, variable), environ[variable]))
    return tuple(out)


def write_key_file(key_file: KeyFile) -> None:
    """Write the key into its file atomically, mode 0600 (folder 0700 if created). Raises OSError."""
    private_mkdir(key_file.path.parent)
    tmp = key_file.path.with_name(f".{key_file.path.name}.tmp")
    with open_private(tmp, "w") as f:
        f.write(key_file.key + "\n")
    os.replace(tmp, key_file.path)


def service_env(environ: Mapping[str, str], program: str, keys: Sequence[KeyFile] = ()) -> tuple[tuple[str, str], ...]:
    """The environment the service starts with. launchd gives agents a bare PATH, so name one that
    finds the interpreter's own bin folder first; HOME is set explicitly for the same reason. The
    secrets of SECRET_ENV are left out: `keys` name the files that hold them."""
    path_dirs = [str(Path(program).parent), "/opt/homebrew/bin", "/usr/local/bin", "/usr/bin", "/bin"]
    env = [
        ("PATH", ":".join(dict.fromkeys(path_dirs))),
        ("HOME", str(Path.home())),
        ("PYTHONUNBUFFERED", "1"),  # log lines reach the log file as they happen
    ]
    own = {k: v for k, v in environ.items() if k.startswith(_ENV_PREFIX) and k not in SECRET_ENV}
    own.update((f"{v}_FILE", os.path.abspath(own[f"{v}_FILE"])) for v in SECRET_ENV if own.get(f"{v}_FILE"))
    own.update((key.file_variable, str(key.path)) for key in keys)
    env += sorted(own.items())
    return tuple(env)


def build_spec(
    label: str,
    log_path: Path,
    config: Config,
    *,
    config_path: Path | None,
    model: str | None,
    port: int | None,
    drain_s: float,
    keys_in: Path | None = None,
) -> ServiceSpec:
    """The ServiceSpec for `config` (already loaded with the same overrides, so it is valid). API
    keys set in the environment go to key files in `keys_in` (default: key_folder). Raises
    ConfigError when a key and its key file variable are both set."""
    args = server_args(config_path, model, port)
    keys = key_files(os.environ, label, keys_in or key_folder(Path.home()))
    return ServiceSpec(
        label=label,
        program_args=tuple(args),
        env=service_env(os.environ, args[0], keys),
        working_dir=default_home(),
        log_path=log_path,
        stop_timeout_s=stop_timeout_s(config.server.shutdown_timeout_s, drain_s),
        key_files=keys,
    )


def run_command(args: list[str], *, capture: bool = True) -> subprocess.CompletedProcess:
    """Run one external command (launchctl, systemctl, tail) and return its result; never raises
    for a non-zero exit. With capture=False the output goes straight to the terminal."""
    try:
        return subprocess.run(args, capture_output=capture, text=True, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(args, 127, "", f"{args[0]}: command not found")


def health_url(program_args: list[str]) -> str:
    """The /health URL of a server started with `program_args` (the installed service's).
    Raises KVServeError when its config file is no longer readable or valid."""

    def flag(name: str) -> str | None:
        return program_args[program_args.index(name) + 1] if name in program_args[:-1] else None

    port = flag("--port")
    config = load_config(flag("--config"), {"server": {"port": int(port) if port else None}})
    host = config.server.host
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.server.port}/health"


def probe_health(url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """GET `url`; (healthy, one-line summary). Uses the standard library so the installed package
    needs no HTTP client dependency."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"{url}: not answering ({reason}); the model may still be loading"
    summary = ", ".join(f"{k} {body[k]}" for k in ("model", "uptime_s", "queue_depth") if k in body)
    return body.get("status") == "ok", f"{url}: {body.get('status', '?')} ({summary})"


def tail_lines(path: Path, num_lines: int) -> list[str]:
    """The last `num_lines` lines of a text file, without their newlines."""
    with open(path, errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=num_lines)]
