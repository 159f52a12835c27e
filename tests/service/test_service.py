"""The service installer: rendered launchd plist and systemd unit, and the commands install/uninstall run.

No service manager is touched: HOME points into tmp_path and the command runner is replaced.
"""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_kvserve.cli import cli
from mlx_kvserve.config import load_config
from mlx_kvserve.service import (
    build_spec,
    commands,
    health_url,
    key_folder,
    launchd,
    stop_timeout_s,
    systemd,
    writer_drain_s,
)

SHUTDOWN_S = 45.0
DRAIN_S = 12.5
UID = os.getuid()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in [k for k in os.environ if k.startswith("MLX_KVSERVE_")]:
        monkeypatch.delenv(name)
    for name in ("XDG_CACHE_HOME", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # so relative --config/--model paths must be made absolute
    return home


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "kvserve.toml"
    path.write_text(f"[server]\nport = 8456\nshutdown_timeout_s = {SHUTDOWN_S}\n")
    return path.resolve()


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "models" / "tiny"
    path.mkdir(parents=True)
    return path.resolve()


@pytest.fixture
def calls(monkeypatch):
    """Replace the command runner; records (args, capture) and answers from `calls.answers`."""

    class Recorder(list):
        def __init__(self):
            super().__init__()
            self.answers: dict[str, subprocess.CompletedProcess] = {}  # keyed by the first three args
            self.watch: Path | None = None  # record whether this file exists at each call
            self.exists_at_call: list[bool] = []

        def __call__(self, args, *, capture=True):
            self.append(list(args))
            if self.watch is not None:
                self.exists_at_call.append(self.watch.exists())
            done = subprocess.CompletedProcess(args, 0, "", "")
            return self.answers.get(" ".join(args[:3]), done) if capture else done

    recorder = Recorder()
    monkeypatch.setattr(commands, "run_command", recorder)
    return recorder


def _spec(backend, config_file: Path, model_dir: Path, home: Path, label: str):
    config = load_config(config_file.name, {"server": {"port": 8456}})
    return build_spec(
        label,
        backend.log_path(label, home),
        config,
        config_path=Path(config_file.name),  # relative on purpose
        model=os.path.relpath(model_dir),
        port=8456,
        drain_s=DRAIN_S,
    )


def _expected_args(config_file: Path, model_dir: Path) -> list[str]:
    return ["-m", "mlx_kvserve", "run", "--config", str(config_file), "--model", str(model_dir), "--port", "8456"]


def test_stop_timeout_covers_both_shutdown_phases_and_the_drain():
    assert stop_timeout_s(30, 0) == 90  # 2 x 30 s + 30 s margin
    assert stop_timeout_s(30, 20) == stop_timeout_s(30, 0) + 20
    assert stop_timeout_s(0.2, 0.1) == 31  # rounded up, never short


def test_writer_drain_is_the_ssd_drain_timeout(tmp_path):
    path = tmp_path / "drain.toml"
    path.write_text("[ssd]\ndrain_timeout_s = 12.5\n")
    assert writer_drain_s(load_config(path)) == 12.5
    assert writer_drain_s(load_config()) == 120.0  # the default ceiling (the drain waits what its bytes take)
    path.write_text("[ssd]\nenabled = false\ndrain_timeout_s = 12.5\n")
    assert writer_drain_s(load_config(path)) == 0.0  # no SSD tier, nothing to drain
    assert stop_timeout_s(30, writer_drain_s(load_config())) == 210  # the default service's timeout


def test_plist_keys(home, config_file, model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "kvhome"))
    job = plistlib.loads(launchd.render_plist(_spec(launchd, config_file, model_dir, home, "com.example.kv")))

    assert job["Label"] == "com.example.kv"
    program = job["ProgramArguments"][0]
    assert os.path.isabs(program) and os.access(program, os.X_OK)
    assert program == os.path.abspath(sys.executable)  # the venv's interpreter, symlink not resolved
    assert job["ProgramArguments"][1:] == _expected_args(config_file, model_dir)
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["RunAtLoad"] is True
    assert isinstance(job["ExitTimeOut"], int) and job["ExitTimeOut"] > SHUTDOWN_S + DRAIN_S
    log = home / "Library" / "Logs" / "mlx-kvserve" / "com.example.kv.log"
    assert job["StandardOutPath"] == job["StandardErrorPath"] == str(log)
    assert job["WorkingDirectory"] == str(tmp_path / "kvhome")
    env = job["EnvironmentVariables"]
    assert env["PYTHONUNBUFFERED"] == "1" and env["HOME"] == str(home)
    assert env["MLX_KVSERVE_HOME"] == str(tmp_path / "kvhome")
    assert env["PATH"].split(":")[0] == os.path.dirname(program)
    assert job["ThrottleInterval"] == 10 and job["ProcessType"] == "Interactive"


def _unit_lines(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("["):
            current = sections.setdefault(line, [])
        elif line:
            current.append(line)
    return sections


def test_unit_lines(home, config_file, model_dir):
    unit = _unit_lines(systemd.render_unit(_spec(systemd, config_file, model_dir, home, "kv")))

    assert set(unit) == {"[Unit]", "[Service]", "[Install]"}
    assert "After=network.target" in unit["[Unit]"]
    service = unit["[Service]"]
    for line in ("Type=simple", "Restart=on-failure", "RestartSec=10", "KillSignal=SIGTERM"):
        assert line in service
    (stop,) = [line for line in service if line.startswith("TimeoutStopSec=")]
    assert int(stop.split("=")[1]) > SHUTDOWN_S + DRAIN_S
    (exec_start,) = [line for line in service if line.startswith("ExecStart=")]
    program, *args = exec_start.removeprefix("ExecStart=").split(" ")
    assert program == os.path.abspath(sys.executable) and os.path.isabs(program)
    assert args == _expected_args(config_file, model_dir)
    log = home / ".local" / "state" / "mlx-kvserve" / "kv.log"
    assert f"StandardOutput=append:{log}" in service and f"StandardError=append:{log}" in service
    assert "Environment=PYTHONUNBUFFERED=1" in service and f"Environment=HOME={home}" in service
    assert unit["[Install]"] == ["WantedBy=default.target"]


def test_unit_quotes_awkward_arguments_so_they_read_back_unchanged(home, config_file, tmp_path):
    model = (tmp_path / 'my models/a b%c$d"e\\f').resolve()
    model.mkdir(parents=True)
    spec = _spec(systemd, config_file, model, home, "kv")
    path = tmp_path / "kv.service"
    path.write_text(systemd.render_unit(spec))
    assert "%%" in path.read_text() and "$$" in path.read_text()
    assert systemd.installed_args(path) == list(spec.program_args)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(home, config_file, model_dir, tmp_path):
    path = tmp_path / "mlx-kvserve.service"
    path.write_text(systemd.render_unit(_spec(systemd, config_file, model_dir, home, "mlx-kvserve")))
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if path.name in line]
    assert result.returncode == 0 and complaints == [], result.stdout + result.stderr


def _invoke(*args: str):
    return CliRunner().invoke(cli, ["service", *args], catch_exceptions=False)


def test_install_and_uninstall_macos(home, config_file, model_dir, calls):
    plist = home / "Library" / "LaunchAgents" / "com.mlx-kvserve.server.plist"
    calls.answers[f"launchctl bootout gui/{UID}/com.mlx-kvserve.server"] = subprocess.CompletedProcess([], 3)
    calls.watch = plist

    result = _invoke("install", "--platform", "macos", "--config", config_file.name, "--model", "models/tiny")
    assert result.exit_code == 0, result.output
    target = f"gui/{UID}/com.mlx-kvserve.server"
    assert calls == [["launchctl", "bootout", target], ["launchctl", "bootstrap", f"gui/{UID}", str(plist)]]
    assert calls.exists_at_call == [True, True]  # written before launchd is asked to load it
    expected = _expected_args(config_file, model_dir)[:-2]  # no --port: the config file's port applies
    assert plistlib.loads(plist.read_bytes())["ProgramArguments"][1:] == expected
    assert (home / "Library" / "Logs" / "mlx-kvserve").is_dir()

    calls.clear()
    result = _invoke("uninstall", "--platform", "macos")
    assert result.exit_code == 0, result.output
    assert calls == [["launchctl", "bootout", target]]
    assert not plist.exists()


def test_install_reports_a_failed_bootstrap(home, calls):
    failed = subprocess.CompletedProcess([], 5, "", "Bootstrap failed: 5: Input/output error")
    calls.answers[f"launchctl bootstrap gui/{UID}"] = failed
    result = CliRunner().invoke(cli, ["service", "install", "--platform", "macos"])
    assert result.exit_code == 1
    assert "launchctl bootstrap" in result.output and "Input/output error" in result.output


def test_install_and_uninstall_linux(home, config_file, calls):
    unit = home / ".config" / "systemd" / "user" / "kv-test.service"
    calls.watch = unit

    result = _invoke("install", "--platform", "linux", "--label", "kv-test", "--config", str(config_file))
    assert result.exit_code == 0, result.output
    assert calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "kv-test.service"],
        ["systemctl", "--user", "restart", "kv-test.service"],
    ]
    assert calls.exists_at_call == [True, True, True]
    assert systemd.installed_args(unit)[1:] == ["-m", "mlx_kvserve", "run", "--config", str(config_file)]
    assert (home / ".local" / "state" / "mlx-kvserve").is_dir()
    assert "loginctl enable-linger" in result.output

    calls.clear()
    calls.exists_at_call.clear()
    result = _invoke("uninstall", "--platform", "linux", "--label", "kv-test")
    assert result.exit_code == 0, result.output
    assert calls == [
        ["systemctl", "--user", "disable", "--now", "kv-test.service"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    assert calls.exists_at_call == [True, False]  # stopped while present, reloaded after removal
    assert not unit.exists()


@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_dry_run_prints_file_and_commands_and_touches_nothing(home, config_file, calls, platform):
    result = _invoke("install", "--dry-run", "--platform", platform, "--config", str(config_file))
    assert result.exit_code == 0, result.output
    assert calls == [] and not home.exists()
    if platform == "macos":
        plist = home / "Library" / "LaunchAgents" / "com.mlx-kvserve.server.plist"
        start, end = result.output.index("<?xml"), result.output.index("</plist>") + len("</plist>")
        assert plistlib.loads(result.output[start:end].encode())["ExitTimeOut"] > SHUTDOWN_S
        assert f"launchctl bootout gui/{UID}/com.mlx-kvserve.server" in result.output
        assert f"\nlaunchctl bootstrap gui/{UID} {plist}\n" in result.output
    else:
        assert "\n[Service]\n" in result.output and "\nRestart=on-failure\n" in result.output
        assert "\nsystemctl --user daemon-reload\nsystemctl --user enable mlx-kvserve.service\n" in result.output


def test_bad_label_is_refused(home, calls):
    result = CliRunner().invoke(cli, ["service", "install", "--platform", "linux", "--label", "../evil"])
    assert result.exit_code == 2 and "--label" in result.output
    assert calls == [] and not home.exists()


def test_health_url_follows_config_and_port_flag(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[server]\nhost = "0.0.0.0"\nport = 9001\n')
    assert health_url(["py", "-m", "mlx_kvserve", "run", "--config", str(config)]) == "http://127.0.0.1:9001/health"
    args = ["py", "-m", "mlx_kvserve", "run", "--config", str(config), "--port", "9002"]
    assert health_url(args) == "http://127.0.0.1:9002/health"


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "model": "tiny", "uptime_s": 3.5, "queue_depth": 0}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_status_reports_service_manager_and_health(home, calls):
    server = HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _invoke("install", "--platform", "linux", "--port", str(port)).exit_code == 0
        calls.clear()
        active = "● mlx-kvserve.service\n     Active: active (running)"
        calls.answers["systemctl --user status"] = subprocess.CompletedProcess([], 0, active, "")
        result = CliRunner().invoke(cli, ["service", "status", "--platform", "linux"])
        assert result.exit_code == 0, result.output
        assert calls == [["systemctl", "--user", "status", "--no-pager", "mlx-kvserve.service"]]
        assert "Active: active (running)" in result.output
        assert f"http://127.0.0.1:{port}/health: ok (model tiny, uptime_s 3.5, queue_depth 0)" in result.output
    finally:
        server.shutdown()
        server.server_close()
    result = CliRunner().invoke(cli, ["service", "status", "--platform", "linux"])
    assert result.exit_code == 1 and "not answering" in result.output


def test_status_when_not_installed(home, calls):
    result = CliRunner().invoke(cli, ["service", "status", "--platform", "macos"])
    assert result.exit_code == 1 and "not installed" in result.output and calls == []


def test_launchctl_print_summary_keeps_state_pid_and_exit_code():
    output = "gui/501/x = {\n\tactive count = 1\n\tstate = running\n\tprogram = /py\n\tpid = 4242\n"
    output += "\tlast exit code = (never exited)\n\tspawn type = daemon (3)\n}\n"
    assert launchd.summarise_status(output).splitlines() == [
        "state = running",
        "pid = 4242",
        "last exit code = (never exited)",
    ]


@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_logs_tail_and_follow(home, calls, platform):
    backend = launchd if platform == "macos" else systemd
    log = backend.log_path(backend.DEFAULT_LABEL, home)
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(100)))

    result = _invoke("logs", "--platform", platform, "-n", "3")
    assert result.output.splitlines() == ["line 97", "line 98", "line 99"]
    assert calls == []
    result = _invoke("logs", "--platform", platform, "-n", "5", "--follow")
    assert result.exit_code == 0 and calls == [["tail", "-n", "5", "-F", str(log)]]


NO_BUS = subprocess.CompletedProcess([], 1, "", "Failed to connect to bus: No medium found\n")


def test_without_a_user_service_manager_install_fails_clearly_and_leaves_nothing(home, calls, monkeypatch):
    """A container or a root shell without a login session has no user systemd: say so, write nothing."""
    monkeypatch.setenv("MLX_KVSERVE_API_KEY", "sk-service-test")  # install writes a key file first
    unit = home / ".config" / "systemd" / "user" / "mlx-kvserve.service"
    calls.answers["systemctl --user daemon-reload"] = NO_BUS
    result = CliRunner().invoke(cli, ["service", "install", "--platform", "linux"])
    assert result.exit_code == 1
    assert "no user service manager" in result.output and "Failed to connect to bus" in result.output
    assert not unit.exists() and not any(key_folder(home).glob("*")), "install left files behind"
    calls.answers["systemctl --user status"] = NO_BUS
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\n")  # as an older install left it
    result = CliRunner().invoke(cli, ["service", "status", "--platform", "linux"])
    assert result.exit_code == 1 and "no user service manager" in result.output
    assert "loading" not in result.output
    calls.answers["systemctl --user disable"] = NO_BUS
    result = CliRunner().invoke(cli, ["service", "uninstall", "--platform", "linux"])
    assert result.exit_code == 0, result.output
    assert not unit.exists() and f"removed {unit}" in result.output


def test_install_refuses_a_server_open_beyond_loopback_without_a_key(home, tmp_path, calls, monkeypatch):
    """`run` would refuse to start it (server/local_guard.py), and the service manager restart it again and
    again: install says so first and changes nothing; a key, or allow_no_key said out loud, lets it through."""
    exposed = tmp_path / "exposed.toml"
    exposed.write_text('[server]\nhost = "0.0.0.0"\nport = 8456\n')
    result = _invoke("install", "--platform", "linux", "--config", str(exposed))
    assert result.exit_code != 0 and "server.allow_no_key" in result.output
    assert calls == [] and not home.exists()
    monkeypatch.setenv("MLX_KVSERVE_API_KEY", "sk-test-key-0123456789")
    assert _invoke("install", "--dry-run", "--platform", "linux", "--config", str(exposed)).exit_code == 0
    monkeypatch.delenv("MLX_KVSERVE_API_KEY")
    exposed.write_text('[server]\nhost = "0.0.0.0"\nport = 8456\nallow_no_key = true\n')
    result = _invoke("install", "--dry-run", "--platform", "linux", "--config", str(exposed))
    assert result.exit_code == 0 and "ANYONE WHO CAN REACH IT CAN USE IT" in result.output
