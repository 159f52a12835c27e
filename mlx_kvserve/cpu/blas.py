"""Fast BLAS on Linux without the user knowing.

The `mlx-cpu` wheel links the slow reference BLAS. When Debian's OpenBLAS is installed, the CLI
re-executes itself once with it in LD_PRELOAD (MLX then resolves BLAS symbols to OpenBLAS),
which makes float32 prefill many times faster. `MLX_KVSERVE_FAST_BLAS=0` turns this off. The same
re-execution sets glibc's malloc tunables that keep freed memory warm (cpu/warm_memory.py).
This module must not import mlx: it runs before MLX is loaded.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from . import warm_memory

ENV_SWITCH = "MLX_KVSERVE_FAST_BLAS"
_REEXEC_MARK = "_MLX_KVSERVE_BLAS_REEXEC"


def openblas_path() -> Path | None:
    """The OpenBLAS library to preload, or None when none is installed (or not on Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    arch = platform.machine()
    for candidate in (
        f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
        f"/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
        f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
    ):
        if Path(candidate).exists():
            return Path(candidate)
    return None


def is_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) with OpenBLAS preloaded and glibc's malloc tunables set
    (cpu/warm_memory.py) where those apply."""
    env = warm_memory.with_tunables(dict(os.environ if env is None else env))
    lib = openblas_path()
    if lib is None or not is_enabled() or str(lib) in env.get("LD_PRELOAD", ""):
        return env
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return env


def reexec_with_fast_blas() -> None:
    """Replace this process with itself plus OpenBLAS preloaded, once; return if not needed."""
    if os.environ.get(_REEXEC_MARK) or "mlx" in sys.modules:
        return
    env = preload_env()
    if env == dict(os.environ):
        return
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "mlx_kvserve", *sys.argv[1:]], env)


def mapped_blas(pid: int | str = "self") -> str:
    """Which BLAS a process has mapped (Linux: /proc/<pid>/maps): 'openblas (<path>)',
    'accelerate', 'reference' or 'unknown'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "unknown"
    lib = openblas_path()
    if lib is not None and os.path.realpath(lib) in maps:
        return f"openblas ({os.path.realpath(lib)})"
    return "reference"


def blas_in_use() -> str:
    """Which BLAS this process has mapped, with a hint when it is the slow reference one."""
    blas = mapped_blas()
    return "reference (slow; install libopenblas0-pthread for fast float32)" if blas == "reference" else blas
