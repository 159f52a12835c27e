"""macOS: the server as a LaunchAgent in the user's GUI session (`launchctl bootstrap gui/<uid>`).

An agent, not a daemon: it runs as the user, after login, with access to the user's files and the GPU.
"""

from __future__ import annotations

import plistlib
from pathlib import Path

from . import ServiceSpec, Step

DEFAULT_LABEL = "com.mlx-kvserve.server"
THROTTLE_INTERVAL_S = 10  # launchd waits this long between restarts after a crash
_STATUS_KEYS = ("state =", "pid =", "last exit code =", "runs =", "path =")


def service_path(label: str, home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{label}.plist"


def log_path(label: str, home: Path) -> Path:
    return home / "Library" / "Logs" / "mlx-kvserve" / f"{label}.log"


def render_plist(spec: ServiceSpec) -> bytes:
    """The LaunchAgent plist for `spec`, as XML bytes."""
    job = {
        "Label": spec.label,
        "ProgramArguments": list(spec.program_args),
        "WorkingDirectory": str(spec.working_dir),
        "EnvironmentVariables": dict(spec.env),
        "RunAtLoad": True,  # start at login and when installed, not on first request
        # Restart after a crash or a kill, but not after a clean exit (launchctl kill TERM, bootout).
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_INTERVAL_S,
        # SIGTERM to SIGKILL: long enough for in-flight requests and the SSD writer's flush.
        "ExitTimeOut": spec.stop_timeout_s,
        "StandardOutPath": str(spec.log_path),
        "StandardErrorPath": str(spec.log_path),
        # Unspecified (= Standard) gets light CPU and I/O throttling; a server the user waits on
        # for every token should run unthrottled, like an app.
        "ProcessType": "Interactive",
    }
    return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=False)


def render_file(spec: ServiceSpec) -> bytes:
    return render_plist(spec)


def installed_args(path: Path) -> list[str]:
    """ProgramArguments of the plist at `path`. Raises OSError or plistlib.InvalidFileException."""
    return list(plistlib.loads(path.read_bytes())["ProgramArguments"])


def _target(label: str, uid: int) -> str:
    return f"gui/{uid}/{label}"


def install_steps(spec: ServiceSpec, path: Path, uid: int) -> list[Step]:
    """Run after the plist is written: unload any running copy (fails when none is loaded), then
    load the new file, which starts it (RunAtLoad)."""
    return [
        Step(["launchctl", "bootout", _target(spec.label, uid)], may_fail=True),
        Step(["launchctl", "bootstrap", f"gui/{uid}", str(path)]),
    ]


def uninstall_steps(label: str, uid: int) -> tuple[list[Step], list[Step]]:
    """(before removing the plist, after removing it). bootout stops the server with SIGTERM and
    waits for it, up to ExitTimeOut."""
    return [Step(["launchctl", "bootout", _target(label, uid)], may_fail=True)], []


def status_command(label: str, uid: int) -> list[str]:
    return ["launchctl", "print", _target(label, uid)]


def summarise_status(output: str) -> str:
    """The few lines of `launchctl print` that say whether the server runs and how it last ended."""
    lines = [line.strip() for line in output.splitlines()]
    picked = [line for line in lines if line.startswith(_STATUS_KEYS)]
    return "\n".join(dict.fromkeys(picked)) or output.strip()
