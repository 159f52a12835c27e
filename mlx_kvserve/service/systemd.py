"""Linux: the server as a systemd user unit (`systemctl --user`), running as the user who installs it.

Unit files expand `%` specifiers everywhere and `$` variables in ExecStart, and unquote with C-style
escapes (see systemd.syntax(7)); `_quote` writes values that come back unchanged.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from . import ServiceSpec, Step

DEFAULT_LABEL = "mlx-kvserve"
RESTART_SEC = 10  # pause between a crash and the restart, like launchd's ThrottleInterval
_BARE = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")  # needs no quotes in ExecStart


def service_path(label: str, home: Path) -> Path:
    return home / ".config" / "systemd" / "user" / f"{label}.service"


def log_path(label: str, home: Path) -> Path:
    state = os.environ.get("XDG_STATE_HOME") or home / ".local" / "state"
    return Path(state) / "mlx-kvserve" / f"{label}.log"


def _escape(value: str) -> str:
    return value.replace("%", "%%")


def _quote(arg: str, *, in_exec: bool = True) -> str:
    """One ExecStart argument (or Environment= assignment): double-quoted when it needs it."""
    if not _BARE.match(arg):
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    arg = _escape(arg)
    return arg.replace("$", "$$") if in_exec else arg


def render_unit(spec: ServiceSpec) -> str:
    """The systemd unit file for `spec`."""
    exec_start = " ".join(_quote(arg) for arg in spec.program_args)
    env_lines = [f"Environment={_quote(f'{k}={v}', in_exec=False)}" for k, v in spec.env]
    log = _escape(str(spec.log_path))
    lines = [
        "[Unit]",
        f"Description={_escape(spec.description)}",
        "After=network.target",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={exec_start}",
        f"WorkingDirectory={_escape(str(spec.working_dir))}",
        *env_lines,
        # Restart after a crash or a kill, but not after a clean exit (systemctl stop sends SIGTERM,
        # which the server answers by draining and exiting 0).
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        "KillSignal=SIGTERM",
        # SIGTERM to SIGKILL: long enough for in-flight requests and the SSD writer's flush.
        f"TimeoutStopSec={spec.stop_timeout_s}",
        f"StandardOutput=append:{log}",
        f"StandardError=append:{log}",
        "",
        "[Install]",
        "WantedBy=default.target",
    ]
    return "\n".join(lines) + "\n"


def render_file(spec: ServiceSpec) -> bytes:
    return render_unit(spec).encode()


def installed_args(path: Path) -> list[str]:
    """The ExecStart arguments of the unit at `path`. Raises OSError, or ValueError without one."""
    for line in path.read_text().splitlines():
        if line.startswith("ExecStart="):
            value = line.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$")
            return shlex.split(value)
    raise ValueError(f"{path}: no ExecStart line")


def _unit(label: str) -> str:
    return f"{label}.service"


def install_steps(spec: ServiceSpec, path: Path, uid: int) -> list[Step]:
    """Run after the unit is written. `restart` rather than `enable --now`: enable --now leaves an
    already running server on the old unit, restart (re)starts it on the new one."""
    systemctl = ["systemctl", "--user"]
    return [
        Step([*systemctl, "daemon-reload"]),
        Step([*systemctl, "enable", _unit(spec.label)]),
        Step([*systemctl, "restart", _unit(spec.label)]),
    ]


def uninstall_steps(label: str, uid: int) -> tuple[list[Step], list[Step]]:
    """(before removing the unit, after removing it). `disable --now` stops the server with SIGTERM
    and waits up to TimeoutStopSec; it fails harmlessly when the unit is not loaded."""
    return (
        [Step(["systemctl", "--user", "disable", "--now", _unit(label)], may_fail=True)],
        [Step(["systemctl", "--user", "daemon-reload"])],
    )


def status_command(label: str, uid: int) -> list[str]:
    return ["systemctl", "--user", "status", "--no-pager", _unit(label)]


def summarise_status(output: str) -> str:
    """`systemctl status` is already a summary: state, pid, memory, and systemd's own last messages."""
    return output.strip()
