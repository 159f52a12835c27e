"""Command line: `mlx-kvserve run | convert | config show`. MLX is imported only inside commands,
after the process has had its chance to re-execute with a fast BLAS."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import click

from .cache_cli import cache_group
from .clean_exit import serve_then_exit
from .config import ROUTER_POLICIES, Config, as_dict, key_overrides, load_api_keys, load_config
from .cpu import blas, warm_memory
from .errors import KVServeError
from .launch.command import launch
from .model_entries import load_model_entries
from .models_cli import models_group
from .service.commands import service_group

log = logging.getLogger("mlx_kvserve")
API_KEY_ENV = "MLX_KVSERVE_API_KEY"
ADMIN_API_KEY_ENV = "MLX_KVSERVE_ADMIN_API_KEY"
# Files holding those keys: what an installed service names, so no key is written into its unit or plist.
API_KEY_FILE_ENV = "MLX_KVSERVE_API_KEY_FILE"
ADMIN_API_KEY_FILE_ENV = "MLX_KVSERVE_ADMIN_API_KEY_FILE"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _load(config_path: str | None, overrides: dict) -> Config:
    try:
        return load_config(config_path, overrides)
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


@click.group()
@click.version_option(package_name="mlx-kvserve")
def cli() -> None:
    """A local OpenAI-compatible LLM server whose KV cache outlives requests and restarts."""


def _config_options(fn):
    fn = click.option(
        "--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="TOML config file."
    )(fn)
    fn = click.option("--model", help="'default', a Hugging Face repo id, an MLX folder or a .gguf file.")(fn)
    fn = click.option(
        "--dtype", type=click.Choice(["float32", "float16", "bfloat16", "keep"]), help="dtype for .gguf conversion."
    )(fn)
    fn = click.option("--host", help="Address to bind (default 127.0.0.1).")(fn)
    fn = click.option("--port", type=int, help="Port to bind (default 8000).")(fn)
    fn = click.option(
        "--api-key", help=f"Key clients must send as 'Authorization: Bearer <key>' (shows in ps; see ${API_KEY_ENV})."
    )(fn)
    fn = click.option("--api-key-file", type=click.Path(dir_okay=False), help="File holding the API key.")(fn)
    return fn


def _overrides(model, dtype, host, port, api_key=None, api_key_file=None) -> dict:
    """Flags over the environment over the file; an API key from a flag or variable replaces
    whichever kind of key (inline or file) the file set."""
    if api_key and api_key_file:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    server = {"host": host, "port": port}
    for name, key_env, file_env in (
        ("admin_api_key", ADMIN_API_KEY_ENV, ADMIN_API_KEY_FILE_ENV),
        ("api_key", API_KEY_ENV, API_KEY_FILE_ENV),
    ):
        key, path = os.environ.get(key_env), os.environ.get(file_env)
        if key and path:
            raise click.UsageError(f"set ${key_env} or ${file_env}, not both")
        server.update(key_overrides(name, key, path))
    server.update(key_overrides("api_key", api_key, api_key_file))
    return {"server": server, "model": {"path": model, "dtype": dtype}}


@cli.command()
@_config_options
@click.option(
    "--distributed",
    type=click.Choice(["tensor", "pipeline"]),
    default=None,
    help="Run one model across the processes `mlx.launch` started (every rank runs this command; rank 0 serves HTTP).",
)
def run(config_path, model, dtype, host, port, api_key, api_key_file, distributed) -> None:
    """Load the model and serve the OpenAI API."""
    blas.reexec_with_fast_blas()
    launcher = os.getppid()  # distributed: mlx.launch (the ranks leave when it is gone: rank_exit.py)
    _leave_with_parent()
    config = _load(config_path, _overrides(model, dtype, host, port, api_key, api_key_file))
    _setup_logging(config.server.log_level)
    try:
        keys = load_api_keys(config.server)  # before the model loads: a bad key file fails fast
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    if distributed and keys.isolated(config.cache.isolation):  # ranks would hash apart (server/app.py)
        raise click.ClickException('cache.isolation: "per_key" does not work with --distributed yet; set "shared"')
    _log_access(config, keys.inference, keys.admin)
    if not distributed:  # ranks on one machine would race for the test bind; rank 0 binds the port anyway
        _check_port(config.server.host, config.server.port)  # in seconds, not after the model has loaded
    import uvicorn

    from .engine.engine import Engine
    from .models.loader import load_model
    from .server.app import create_app

    log.info("BLAS in use: %s; malloc tunables: %s", blas.blas_in_use(), warm_memory.in_effect())
    registry_app = _registry_app(config, config_path, model, distributed, keys)
    if registry_app is not None:  # [[models]]: several models, loaded on demand (registry/registry.py)
        _install_cpu_attention(config)  # not known yet which: as for a model of several layers
        signal.signal(signal.SIGTERM, _exit_cleanly)
        server = config.server
        serve_then_exit(
            lambda: uvicorn.run(
                registry_app,
                host=server.host,
                port=server.port,
                log_level=server.log_level,
                timeout_graceful_shutdown=server.shutdown_timeout_s,
                access_log=False,
            )
        )
    world = _world(distributed)
    rank_exit = None
    if world is not None:  # leave when the launcher is stopped (it forwards no signal), within a bound
        from .rank_exit import guard_rank

        stop_s = config.server.shutdown_timeout_s + config.ssd.drain_timeout_s
        rank_exit = guard_rank(world.rank, stop_s, launcher)
    try:
        shard = (world.group, world.mode) if world is not None else None
        loaded = load_model(
            config.model.path,
            config.models_path(),
            config.model.dtype,
            config.model.served_name,
            shard,
            config.model.chat_template,
        )
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    layers = getattr(loaded.model, "layers", None)  # mlx-lm's models list them; a wrapper may not
    _install_cpu_attention(config, None if layers is None else len(layers))
    try:
        engine = Engine(loaded, config, world)
    except KVServeError as exc:  # e.g. another server holds the cache folder: say so, exit 1
        log.error("%s", exc.message)
        raise click.ClickException(exc.message) from None
    if world is not None and world.rank != 0:
        log.info("rank %d of %d (%s parallel): following rank 0", world.rank, world.size, world.mode)
        serve_then_exit(engine.serve_follower)
    app = create_app(engine, keys)
    # uvicorn re-raises the SIGTERM it handled once its graceful shutdown is done, which would end
    # the process as killed by the signal; for service managers that shutdown is a clean exit (0).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    serve_then_exit(
        lambda: uvicorn.run(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            timeout_graceful_shutdown=config.server.shutdown_timeout_s,
            access_log=False,  # the mlx_kvserve.requests logger writes one richer line per request
        ),
        # the worker thread may be stuck in a collective: bound the exit
        before_exit=(lambda: rank_exit.deadline("shut down")) if rank_exit is not None else None,
    )


def _check_port(host: str, port: int) -> None:
    """Refuse now (ClickException) when `host:port` cannot be bound, as uvicorn would only after the
    model has loaded. SO_REUSEADDR as uvicorn sets it, so a port in TIME_WAIT is not taken for in use."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        reason = "in use (another server?)" if exc.errno == errno.EADDRINUSE else f"not usable ({exc.strerror or exc})"
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {reason}; stop what holds it or choose another port (--port or "
            "server.port)"
        ) from None


def _install_cpu_attention(config: Config, num_layers: int | None = None) -> None:
    """On the CPU, MLX's attention with its softmax in NumPy where that wins (cpu/attention.py)."""
    from .cpu import attention as cpu_attention

    g = config.generation
    if cpu_attention.install(g.cpu_attention_rows, g.cpu_attention_softmax, num_layers):
        log.info("CPU attention: softmax in NumPy, %d-row causal blocks (cpu/attention.py)", g.cpu_attention_rows)


def _leave_with_parent() -> None:
    """A model's own process (server/model_process.py) stops as SIGTERM stops it once the server that
    started it is gone (a crash, kill -9), so it never keeps the port and the cache folder's lock."""
    parent = _parent_pid()
    if parent is None:
        return
    from .rank_exit import RankExit

    RankExit(0, 0).watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM), parent, poll_s=0.5)


def _parent_pid() -> int | None:
    """The server this process serves a model for (server/model_process.py sets it), else None."""
    from .server.model_process import PARENT_PID_ENV

    value = os.environ.get(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def _registry_app(config: Config, config_path: str | None, model: str | None, distributed: str | None, keys):
    """The app of a server with several models, or None without [[models]] in the config file."""
    from .model_entries import load_model_entries

    try:
        entries = load_model_entries(config_path)
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    if not entries:
        return None
    if distributed:
        raise click.UsageError("--distributed serves one model: remove the [[models]] entries")
    from .registry.front import RoutedEngine
    from .registry.registry import ModelRegistry, registry_entries
    from .server.app import create_app
    from .server.model_process import load_entry

    # A model's own process (its parent set PARENT_PID_ENV) keeps its one folder within the
    # ssd.max_bytes its parent lent it: no budget over the other folders, which the parent counts.
    own_process = _parent_pid() is not None
    try:  # the memory plan refuses budgets that do not fit (engine/memory/plan.py)
        registry = ModelRegistry(config, registry_entries(entries, model), single=own_process, loader=load_entry)
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    log.info("models: %s (memory budget %.2f GiB)", ", ".join(registry.names), registry.budget_bytes / 2**30)
    return create_app(RoutedEngine(registry), keys, registry)


def _world(mode: str | None):
    """This process's rank among those `mlx.launch` started, or None when not distributed."""
    if mode is None:
        return None
    import mlx.core as mx

    from .engine.distributed import World

    group = mx.distributed.init()
    if group.size() < 2:
        raise click.ClickException("--distributed needs several processes: start them with mlx.launch")
    return World(group, mode)


def _log_access(config: Config, inference_key: str, admin_key: str) -> None:
    log.info(
        "API key: %s; cache admin: %s",
        "required" if inference_key else "none (open)",
        "own key" if admin_key else ("the API key" if inference_key else "open"),
    )
    s = config.server
    _check_browsers(s.host, s.allowed_hosts, s.allowed_origins, bool(inference_key), s.allow_no_key, "server")


def _check_browsers(host: str, hosts: list[str], origins: list[str], has_key: bool, allow_no_key: bool, section: str):
    """Before anything loads: the allowed hosts and origins parse, and a server without a key listens
    beyond loopback only with allow_no_key, said loudly (server/local_guard.py)."""
    from .server.local_guard import check_exposure, guard_policy

    try:
        guard_policy(host, hosts, origins, section)
        warning = check_exposure(host, has_key, allow_no_key, section)
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    if warning:
        log.warning("%s", warning)


@cli.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--dtype", type=click.Choice(["float32", "float16", "bfloat16", "keep"]), default="float32", show_default=True
)
def convert(src: Path, dst: Path, dtype: str) -> None:
    """Convert a llama-family GGUF file into an MLX model folder."""
    blas.reexec_with_fast_blas()
    from .models.gguf import convert_gguf

    try:
        convert_gguf(src, dst, dtype, progress=lambda msg: click.echo(msg, err=True))  # type: ignore[arg-type]
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None


@cli.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("show")
@_config_options
def config_show(config_path, model, dtype, host, port, api_key, api_key_file) -> None:
    """Print the effective configuration (file + variables + flags + defaults) as JSON, keys redacted."""
    config = _load(config_path, _overrides(model, dtype, host, port, api_key, api_key_file))
    shown = as_dict(config, redact=True)
    try:  # [[models]] live beside the sections (model_entries.py): shown with them, as they are served
        shown["models"] = [dataclasses.asdict(entry) for entry in load_model_entries(config_path)]
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    click.echo(json.dumps(shown, indent=2))


ROUTER_API_KEY_ENV = "MLX_KVSERVE_ROUTER_API_KEY"
BACKEND_API_KEY_ENV = "MLX_KVSERVE_BACKEND_API_KEY"


@cli.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="TOML config ([router]).")
@click.option("--backend", "backends", multiple=True, help="Base URL of an mlx-kvserve server (repeat for each).")
@click.option("--policy", type=click.Choice(ROUTER_POLICIES), help="Routing policy (default unified).")
@click.option("--overload-factor", type=float, help="unified: leave a session's backend above this x average load.")
@click.option("--tokenizer", help="Tokenizer (model folder or hub id); default: the model the backends report.")
@click.option("--host", help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, help="Port to bind (default 8100).")
@click.option(
    "--api-key-file", type=click.Path(dir_okay=False), help=f"Key clients must send (or ${ROUTER_API_KEY_ENV})."
)
@click.option(
    "--backend-api-key-file",
    type=click.Path(dir_okay=False),
    help=f"Key sent to the backends (or ${BACKEND_API_KEY_ENV}).",
)
def router(
    config_path, backends, policy, overload_factor, tokenizer, host, port, api_key_file, backend_api_key_file
) -> None:
    """Route requests across several servers, to the one whose cache holds the conversation."""
    overrides = {
        "backends": list(backends) or None,
        "policy": policy,
        "overload_factor": overload_factor,
        "tokenizer": tokenizer,
        "listen_host": host,
        "listen_port": port,
    }
    for name, env, path in (
        ("api_key", ROUTER_API_KEY_ENV, api_key_file),
        ("backend_api_key", BACKEND_API_KEY_ENV, backend_api_key_file),
    ):
        overrides.update(key_overrides(name, os.environ.get(env) if not path else None, path))
    try:
        config = load_config(config_path, {"router": overrides})
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    rc = config.router
    if not rc.backends:
        raise click.UsageError("name at least one backend: --backend URL or router.backends in the config")
    _setup_logging(rc.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request and poll otherwise
    has_key = bool(rc.api_key or rc.api_key_file)
    _check_browsers(rc.listen_host, rc.allowed_hosts, rc.allowed_origins, has_key, rc.allow_no_key, "router")
    import uvicorn

    from .router.app import create_router_app

    try:
        app = create_router_app(rc)
    except KVServeError as exc:
        raise click.ClickException(exc.message) from None
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(app, host=rc.listen_host, port=rc.listen_port, log_level=rc.log_level, access_log=False)


cli.add_command(service_group)
cli.add_command(cache_group)
cli.add_command(models_group)
cli.add_command(launch)


def main() -> None:
    cli(prog_name="mlx-kvserve")


if __name__ == "__main__":
    sys.exit(main())
