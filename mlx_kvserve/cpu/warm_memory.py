"""Freed memory kept for the next request on Linux, as MLX's buffer cache keeps it on a Mac.

On the CPU, MLX's arrays come from glibc's malloc, which hands large freed blocks back to the system
(an array over its mmap threshold is unmapped when freed; a heap whose free top passes the trim
threshold is cut, and the memory of a thread's own arena is released the same way). The next
request's arrays of the same sizes (a prefix assembled from its blocks, a prefill's scores) then
start on fresh pages, and the system zero-fills each 4 KiB page on first write: on this project's CPU
machine, assembling a 0.54 GiB prefix took 0.16 s into fresh pages and 0.05 s into reused ones
(scripts/bench_warm_memory.py), a fifth of a new question's time to first token.

glibc reads its tunables when a process starts, so the CLI's re-execution (cpu/blas.py, which preloads
OpenBLAS) sets them, and `python -m mlx_kvserve.cpu.blas_exec` for the tests and scripts:
- arrays up to 32 MiB come from the heap (glibc.malloc.mmap_threshold, its largest value), not from
  mappings of their own that every free unmaps;
- up to `keep_bytes()` of free heap stays with the process (glibc.malloc.trim_threshold): a quarter of
  the machine's memory, the share MLX's buffer cache would keep on a Mac is larger;
- one arena for every thread (glibc.malloc.arena_max=1): MLX allocates on its stream threads and the
  worker frees, and a per-thread arena hands its memory back on its own.
All three are needed (each alone leaves the fresh-page cost). The server's memory as the system counts
it then stays near its peak, as with MLX's buffer cache on a Mac. `MLX_KVSERVE_WARM_MEMORY=0` turns this
off; a GLIBC_TUNABLES the user set is left as it is. This module must not import mlx.
"""

from __future__ import annotations

import os
import sys

ENV_SWITCH = "MLX_KVSERVE_WARM_MEMORY"
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: bigger arrays are mapped (and unmapped) whatever is set


def keep_bytes() -> int:
    """Free heap bytes the process keeps: a quarter of the machine's memory."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 * 2**30
    return max(physical // 4, 256 * 2**20)


def tunables() -> str:
    return (
        f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}"
        f":glibc.malloc.trim_threshold={keep_bytes()}"
        ":glibc.malloc.arena_max=1"
    )


def is_enabled(env: dict[str, str]) -> bool:
    return env.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")


def with_tunables(env: dict[str, str]) -> dict[str, str]:
    """`env` with glibc's malloc tunables set (Linux, switched on, none of the user's own)."""
    if not sys.platform.startswith("linux") or not is_enabled(env) or env.get("GLIBC_TUNABLES"):
        return env
    return {**env, "GLIBC_TUNABLES": tunables()}


def in_effect() -> str:
    """For the startup log: this process's malloc tunables ("none" when unset)."""
    return os.environ.get("GLIBC_TUNABLES") or "none"
