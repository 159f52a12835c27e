"""Server processes for the benches: a free port, start, wait until ready, restart, stop, and the pair
every comparison runs (our server and mlx_lm.server on the same model, same BLAS), with vllm-mlx as a
third where a bench is given its executable."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness import OURS, ROOT, THEIRS, VLLM, default_model_dir
from harness.clients import chat_ttft
from mlx_kvserve.cpu.blas import preload_env


def free_port() -> int:
    """A loopback port no one listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`cmd` as a child process (logging to a temp file) that serves `ready_path` with a 200 when ready."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], ready_path: str):
        self.name, self.port, self.cmd, self.env, self.ready_path = name, port, cmd, env, ready_path
        self.config: dict[str, dict] = {}  # ours: the sections of the config file it was started with
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        self.stop()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(self.ready_path)

    def wait(self, path: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def kvserve_server(model: Path, env: dict[str, str], home: Path | str, *args: str, name: str = OURS) -> Server:
    """`mlx-kvserve run --model model` (and `args`) on a free port with `home` as its MLX_KVSERVE_HOME, ready at
    /health; started, not waited for."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model), "--port", str(port), *args]
    return Server(name, cmd, port, dict(env, MLX_KVSERVE_HOME=str(home)), "/health")


def server_env() -> dict[str, str]:
    """This process's environment with OpenBLAS preloaded where installed (the same BLAS for both servers)."""
    return preload_env(dict(os.environ, PYTHONUNBUFFERED="1"))


def vllm_mlx_server(executable: str, model_dir: Path, home: Path, env: dict[str, str] | None = None) -> Server:
    """vllm-mlx (`executable`: a scratch venv's `vllm-mlx`, 0.6.0 measured) serving `model_dir` as
    "default" on a free port, continuous batching and its prefix cache on; started, not waited for.
    `home` becomes its HOME: it saves its prefix cache under ~/.cache/vllm-mlx and loads it on start,
    so a fresh one keeps first turns cold, as on the other servers."""
    port = free_port()
    cmd = [executable, "serve", str(model_dir), "--port", str(port), "--continuous-batching"]
    cmd += ["--enable-prefix-cache", "--served-model-name", "default"]
    return Server(VLLM, cmd, port, dict(env or server_env(), HOME=str(home)), "/v1/models")


# mlx_lm.server with MLX's buffer cache bounded (argv[1]: bytes), the rest of argv its own arguments
BOUNDED_MLX_LM_SERVER = (
    "import runpy, sys; import mlx.core as mx; mx.set_cache_limit(int(sys.argv.pop(1))); "
    "runpy.run_module('mlx_lm.server', run_name='__main__')"
)


def shared_device_bytes(servers: int) -> int | None:
    """On a GPU with its own memory (MLX's CUDA backend), which the servers of one comparison share while
    each keeps its caches between turns: the bytes each may hold in MLX's buffer cache and in KV caches,
    alike for all (each default is 80% / unbounded for `mlx_lm.server`, a quarter each for ours: two
    servers ran an H100 out of memory at 16 clients). None on unified memory and the CPU."""
    from mlx_kvserve.engine.memory.device import array_memory_bytes, arrays_in_device_memory

    return array_memory_bytes() // (4 * servers) if arrays_in_device_memory() else None


def toml_text(sections: dict[str, dict]) -> str:
    """A config file's text for {section: {key: value}} (strings, numbers and booleans)."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def start_servers(model_dir: Path | None = None, vllm_mlx: str | None = None) -> list[Server]:
    """Our server (fresh MLX_KVSERVE_HOME, default budgets) and mlx_lm.server, then vllm-mlx where its
    executable is given (vllm_mlx_server), ready and warmed up. On a GPU with its own memory both get
    the same bounds (shared_device_bytes): ours in a config file (`Server.config`), theirs by
    `--prompt-cache-bytes` and MLX's cache limit set before it starts."""
    model_dir = model_dir or default_model_dir()
    env = server_env()
    home = tempfile.mkdtemp(prefix="kvserve-bench-")
    theirs_port = free_port()
    share = shared_device_bytes(3 if vllm_mlx else 2)
    config = {"server": {"mlx_cache_limit_bytes": share}, "cache": {"ram_max_bytes": share}} if share else {}
    if config:
        (Path(home) / "config.toml").write_text(toml_text(config))
    ours = kvserve_server(model_dir, env, home, *(["--config", str(Path(home) / "config.toml")] if config else []))
    ours.config = config
    theirs_cmd = [sys.executable, "-m", "mlx_lm.server"]
    if share:
        theirs_cmd = [sys.executable, "-c", BOUNDED_MLX_LM_SERVER, str(share), "--prompt-cache-bytes", str(share)]
    theirs_cmd += ["--model", str(model_dir), "--port", str(theirs_port)]
    theirs = Server(THEIRS, theirs_cmd, theirs_port, env, "/v1/models")
    servers = [ours, theirs]
    if vllm_mlx:
        servers.append(vllm_mlx_server(vllm_mlx, model_dir, Path(tempfile.mkdtemp(prefix="vllm-mlx-home-")), env))
    try:
        for server in servers:
            server.wait(server.ready_path, timeout=600)
        for server in servers:
            chat_ttft(server, [{"role": "user", "content": "warm up"}], 4)  # first-use kernel compilation
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: list[Server]) -> None:
    for server in servers:
        server.stop()
