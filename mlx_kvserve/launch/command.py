"""`mlx-kvserve launch CLIENT [-- CLIENT_ARGS...]`: find the server (or start one), write the client's
private profile, run the client; a server started here is stopped when the client exits."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import click

from ..config import default_home, load_api_keys, load_config
from ..errors import KVServeError
from .clients import CLIENTS, Client
from .profile import Profile, describe, write
from .server import StartedServer
from .target import NO_KEY, KeyRefused, Target, probe

API_KEY_ENV = "MLX_KVSERVE_API_KEY"  # as `mlx-kvserve run` reads it
ANY_ADDRESS = ("0.0.0.0", "::", "")


def launch_folder(client: str) -> Path:
    return default_home() / "launch" / client


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("client", type=click.Choice(sorted(CLIENTS)))
@click.argument("client_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--url", help="A running server's base URL (default: the configured host and port).")
@click.option("--model", help="The model a server started here serves (as `run --model`).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="TOML config file.")
@click.option("--dry-run", is_flag=True, help="Print the environment, files and command, and exit.")
@click.option("--start-timeout", default=900.0, show_default=True, help="Seconds to wait for a started server.")
def launch(client, client_args, url, model, config_path, dry_run, start_timeout) -> None:
    """Run an agent client against this server, with no configuration to write.

    CLIENT is claude, codex, opencode, qwen, cline, aider or llm; arguments after `--` go to it, e.g.
    `mlx-kvserve launch claude -- -p "say hi"`. Finds the server at --url (or the configured
    address); with none there, starts `mlx-kvserve run` with --model/--config and stops it when
    the client exits. The client's settings go in a private folder (<home>/launch/CLIENT) or its
    environment: its own configuration is never edited.
    """
    spec = CLIENTS[client]
    try:
        config = load_config(config_path, {"model": {"path": model}})
        key = os.environ.get(API_KEY_ENV) or load_api_keys(config.server).inference
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    host = "127.0.0.1" if config.server.host in ANY_ADDRESS else config.server.host
    base = (url or f"http://{host}:{config.server.port}").rstrip("/")
    try:
        target = probe(base, key)
    except KeyRefused:
        raise _key_refused(base, key) from None
    if target is None and url:
        raise click.ClickException(f"no mlx-kvserve server answers at {base}/health")
    run_args = _run_args(host, config.server.port, model, config_path)
    if dry_run:
        if target is None:  # what the client would be given once the server it starts is up
            click.echo(f"# no server at {base}: would start `mlx-kvserve run {' '.join(run_args)}` and wait for it")
            target = Target(base, config.model.served_name or _model_name(model), 0, key or NO_KEY)
        click.echo(describe(spec.build(target, launch_folder(client), list(client_args))), nl=False)
        return
    program = _installed(spec)
    started = None
    if target is None:
        started, target = _start_server(base, key, run_args, start_timeout)
    elif model and target.model != _model_name(model):
        click.echo(
            f"note: the server at {base} serves {target.model}; --model applies to a server launch starts", err=True
        )
    profile = spec.build(target, launch_folder(client), list(client_args))
    write(profile)
    context = f"{target.context_length} tokens" if target.context_length else "not reported"
    click.echo(f"{client} -> {target.url}, model {target.model}, context {context}", err=True)
    for note in profile.notes:
        click.echo(f"note: {note}", err=True)
    if started is None:
        os.execvpe(program, [program, *profile.argv[1:]], profile.environment(dict(os.environ)))
    sys.exit(_run_then_stop(program, profile, started))


def _start_server(base: str, key: str, run_args: list[str], timeout_s: float) -> tuple[StartedServer, Target]:
    """`mlx-kvserve run` in the background, once /health answers; stopped again if it never does."""
    log_path = default_home() / "launch" / "server.log"
    click.echo(f"starting the server: mlx-kvserve run {' '.join(run_args)} (log: {log_path})", err=True)
    started = StartedServer(run_args, log_path)
    try:
        return started, started.wait(base, key, timeout_s, lambda msg: click.echo(msg, err=True))
    except BaseException as exc:  # Ctrl-C included: the server runs in its own session, so stop it
        started.stop()
        if isinstance(exc, KVServeError):
            raise click.ClickException(exc.message) from None
        if isinstance(exc, KeyRefused):
            raise _key_refused(base, key) from None
        raise


def _key_refused(base: str, key: str) -> click.ClickException:
    which = "refuses the key given" if key else "wants an API key"
    return click.ClickException(
        f"the server at {base} {which}: set ${API_KEY_ENV} (or server.api_key_file in --config)"
    )


def _run_args(host: str, port: int, model: str | None, config_path: str | None) -> list[str]:
    args = ["--host", host, "--port", str(port)]
    args += ["--model", model] if model else []
    return args + (["--config", config_path] if config_path else [])


def _model_name(model: str | None) -> str:
    """The id a server started with `--model model` will serve, as far as the name tells it."""
    if not model or model == "default":
        from ..models.default import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    if model.endswith(".gguf"):
        return Path(model).stem
    folder = Path(model).expanduser()
    return folder.name if folder.is_dir() else model  # a hub id is served under its own name


def _installed(spec: Client) -> str:
    """The client's program on PATH; a ClickException naming its install command when missing."""
    program = shutil.which(spec.program)
    if program is None:
        raise click.ClickException(f"{spec.program} is not installed (not on PATH). Install it with:\n  {spec.install}")
    return program


def _run_then_stop(program: str, profile: Profile, started: StartedServer) -> int:
    """Run the client in the foreground, then stop the server this launch started; the client's exit
    code. Ctrl-C belongs to the client meanwhile (the server runs in its own session); a SIGTERM or
    SIGHUP (a closed terminal) is passed on to the client, and the server is stopped after it too."""
    running: list[subprocess.Popen] = []

    def pass_on(signum: int, frame: object) -> None:
        if running and signum != signal.SIGINT:  # the terminal sends Ctrl-C to the client itself
            running[0].send_signal(signum)

    # Handlers, not SIG_IGN (which would stay set in the client across exec), in place before it starts.
    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        running.append(subprocess.Popen([program, *profile.argv[1:]], env=profile.environment(dict(os.environ))))
        code = running[0].wait()
        return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + its number
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        click.echo("stopping the server this launch started", err=True)
        started.stop()
