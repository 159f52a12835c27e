"""`mlx-kvserve service install | uninstall | status | logs`: the click side of the service backends."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from types import ModuleType

import click

from ..config import Config, load_config
from ..errors import KVServeError
from ..server.local_guard import check_exposure
from . import (
    PLATFORMS,
    SECRET_ENV,
    ServiceSpec,
    Step,
    build_spec,
    current_platform,
    health_url,
    key_folder,
    key_path,
    launchd,
    probe_health,
    run_command,
    systemd,
    tail_lines,
    write_key_file,
    writer_drain_s,
)

_BACKENDS: dict[str, ModuleType] = {"macos": launchd, "linux": systemd}
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_LINGER_NOTE = (
    "note: systemd stops user services when you log out; to keep the server running, "
    "run `loginctl enable-linger $USER` once."
)


def _backend(platform: str | None) -> ModuleType:
    platform = platform or current_platform()
    if platform not in _BACKENDS:
        raise click.ClickException(f"no service manager support on {platform}; try --platform macos|linux --dry-run")
    return _BACKENDS[platform]


def _label(backend: ModuleType, label: str | None) -> str:
    label = label or backend.DEFAULT_LABEL
    if not _LABEL_RE.match(label):
        raise click.BadParameter(f"{label!r}: use letters, digits, '.', '_' and '-'", param_hint="--label")
    return label


def _load(config_path: Path | None, overrides: dict) -> Config:
    try:
        return load_config(config_path, overrides)
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None


def _show(step: Step) -> str:
    note = "  # fails harmlessly when not loaded" if step.may_fail else ""
    return shlex.join(step.args) + note


# What systemctl --user says where no user systemd runs (a container, a root shell without a login
# session, WSL without systemd): no service can be installed there, whatever the unit says.
_NO_MANAGER = re.compile(
    r"Failed to connect to (the )?bus|DBUS_SESSION_BUS_ADDRESS|XDG_RUNTIME_DIR|not been booted with systemd"
    r"|command not found"
)


class NoServiceManager(click.ClickException):
    """The user service manager cannot be reached: nothing can be installed, started or stopped."""


def _run_steps(steps: list[Step]) -> None:
    """Run each step in order; stop at the first unexpected failure with its command and output
    (NoServiceManager when the failure says there is no user service manager to talk to)."""
    for step in steps:
        result = run_command(step.args)
        output = (result.stderr or result.stdout or "").strip()
        if result.returncode != 0 and _NO_MANAGER.search(output):
            raise NoServiceManager(
                f"no user service manager: `{shlex.join(step.args)}` says {output.splitlines()[0]!r}. "
                "Start the server with `mlx-kvserve run` instead (under tmux, nohup or your own supervisor), "
                "or install from a login session where `systemctl --user status` works."
            )
        if result.returncode != 0 and not step.may_fail:
            raise click.ClickException(f"`{shlex.join(step.args)}` failed (exit {result.returncode}): {output}")


_platform_option = click.option(
    "--platform", type=click.Choice(PLATFORMS), help="Service manager to target (default: this machine's)."
)
_label_option = click.option(
    "--label", help=f"Service name (default: {launchd.DEFAULT_LABEL} on macOS, {systemd.DEFAULT_LABEL} on Linux)."
)


@click.group("service")
def service_group() -> None:
    """Run the server at login: a launchd LaunchAgent on macOS, a systemd user unit on Linux."""


@service_group.command("install")
@click.option(
    "--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="TOML config file."
)
@click.option("--model", help="'default', a Hugging Face repo id, an MLX folder or a .gguf file.")
@_label_option
@click.option("--port", type=int, help="Port to bind (default: from the config, else 8000).")
@click.option("--dry-run", is_flag=True, help="Print the service file and the commands; change nothing.")
@_platform_option
def install(
    config_path: Path | None,
    model: str | None,
    label: str | None,
    port: int | None,
    dry_run: bool,
    platform: str | None,
) -> None:
    """Write the service file, then load and start the service (replacing a running one)."""
    backend = _backend(platform)
    label = _label(backend, label)
    config = _load(config_path, {"server": {"port": port}, "model": {"path": model}})
    _check_exposure(config)
    home = Path.home()
    path = backend.service_path(label, home)
    try:
        spec = build_spec(
            label,
            backend.log_path(label, home),
            config,
            config_path=config_path,
            model=model,
            port=port,
            drain_s=writer_drain_s(config),
        )
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    content = backend.render_file(spec)
    steps = backend.install_steps(spec, path, os.getuid())
    if dry_run:
        _print_plan(path, content, spec, steps)
        return
    for folder in (path.parent, spec.log_path.parent, spec.working_dir):
        folder.mkdir(parents=True, exist_ok=True)
    for key_file in spec.key_files:  # before the service file that names them
        try:
            write_key_file(key_file)
        except OSError as exc:
            raise click.ClickException(f"cannot write the key file {key_file.path}: {exc}") from None
    path.write_bytes(content)
    try:
        _run_steps(steps)
    except click.ClickException:  # leave nothing behind: a unit that was never loaded only misleads `status`
        path.unlink(missing_ok=True)
        for key_file in spec.key_files:
            key_file.path.unlink(missing_ok=True)
        raise
    click.echo(f"installed {path}\nlogs: {spec.log_path}\ncheck: mlx-kvserve service status --label {label}")
    if backend is systemd:
        click.echo(_LINGER_NOTE)


def _check_exposure(config: Config) -> None:
    """What `run` checks before it loads anything (server/local_guard.py): a server without an API key
    listens beyond loopback only with `server.allow_no_key`. Checked here, a service that would refuse
    to start (and be restarted by its manager, again and again) is not installed."""
    s = config.server
    in_env = [v for v, kind in SECRET_ENV.items() if kind == "api"]  # the inference key, or its file
    has_key = bool(s.api_key or s.api_key_file or any(os.environ.get(v) or os.environ.get(f"{v}_FILE") for v in in_env))
    try:
        warning = check_exposure(s.host, has_key, s.allow_no_key, "server")
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    if warning:
        click.echo(f"warning: {warning}", err=True)


def _print_plan(path: Path, content: bytes, spec: ServiceSpec, steps: list[Step]) -> None:
    for key_file in spec.key_files:
        click.echo(f"# would write the key from ${key_file.variable} to {key_file.path} (mode 0600; not shown)")
    click.echo(f"# would write {path}:")
    click.echo(content.decode(), nl=False)
    folders = dict.fromkeys(str(p) for p in (path.parent, spec.log_path.parent, spec.working_dir))
    click.echo(f"# would create folders: {', '.join(folders)}")
    click.echo("# would run:")
    for step in steps:
        click.echo(_show(step))


@service_group.command("uninstall")
@_label_option
@_platform_option
def uninstall(label: str | None, platform: str | None) -> None:
    """Stop the service (letting the server drain), unload it and remove its file. Logs are kept."""
    backend = _backend(platform)
    label = _label(backend, label)
    path = backend.service_path(label, Path.home())
    before, after = backend.uninstall_steps(label, os.getuid())
    try:
        _run_steps(before)
    except NoServiceManager as exc:  # nothing runs under it then: removing the file is all there is to do
        click.echo(exc.message)
        after = []
    existed = path.exists()
    path.unlink(missing_ok=True)
    try:
        _run_steps(after)
    except NoServiceManager as exc:
        click.echo(exc.message)
    click.echo(f"removed {path}" if existed else f"nothing installed at {path}")
    for variable in SECRET_ENV:  # the key files install wrote for this label
        key = key_path(key_folder(Path.home()), label, variable)
        if key.exists():
            key.unlink()
            click.echo(f"removed {key}")


@service_group.command("status")
@_label_option
@_platform_option
@click.pass_context
def status(ctx: click.Context, label: str | None, platform: str | None) -> None:
    """What the service manager says, and whether the server answers /health. Exits 1 unless healthy."""
    backend = _backend(platform)
    label = _label(backend, label)
    path = backend.service_path(label, Path.home())
    if not path.exists():
        click.echo(f"not installed: no {path}")
        ctx.exit(1)
    result = run_command(backend.status_command(label, os.getuid()))
    said = (result.stderr or result.stdout or "").strip()
    if result.returncode != 0 and _NO_MANAGER.search(said):
        click.echo(f"no user service manager: {said.splitlines()[0]}; the service cannot be running")
        ctx.exit(1)
    click.echo(backend.summarise_status(result.stdout or result.stderr or ""))
    try:
        url = health_url(backend.installed_args(path))
    except (KVServeError, OSError, ValueError, KeyError) as exc:
        click.echo(f"health: cannot tell the server's address from {path}: {exc}")
        ctx.exit(1)
    is_healthy, summary = probe_health(url)
    click.echo(f"health: {summary}")
    ctx.exit(0 if is_healthy else 1)


@service_group.command("logs")
@click.option(
    "-n", "--lines", "num_lines", type=click.IntRange(min=0), default=50, show_default=True, help="Lines to print."
)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (tail -F) until Ctrl-C.")
@_label_option
@_platform_option
@click.pass_context
def logs(ctx: click.Context, num_lines: int, follow: bool, label: str | None, platform: str | None) -> None:
    """The end of the server's log file (stdout and stderr of the service)."""
    backend = _backend(platform)
    path = backend.log_path(_label(backend, label), Path.home())
    if follow:
        try:
            ctx.exit(run_command(["tail", "-n", str(num_lines), "-F", str(path)], capture=False).returncode)
        except KeyboardInterrupt:
            return
    if not path.exists():
        raise click.ClickException(f"no log file at {path}; is the service installed?")
    for line in tail_lines(path, num_lines):
        click.echo(line)
