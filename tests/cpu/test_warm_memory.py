"""glibc's malloc tunables the server sets at its start (mlx_kvserve/cpu/warm_memory.py): what they are, who
sets them, and that they keep a freed prefix's pages for the next one (page faults counted, not timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_kvserve.cpu import blas, warm_memory

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables: Linux")


@linux_only
def test_the_tunables_keep_heap_memory_and_use_one_arena():
    env = warm_memory.with_tunables({"PATH": "/bin"})
    settings = dict(item.split("=") for item in env["GLIBC_TUNABLES"].split(":"))
    assert settings == {
        "glibc.malloc.mmap_threshold": str(32 * 2**20),
        "glibc.malloc.trim_threshold": str(warm_memory.keep_bytes()),
        "glibc.malloc.arena_max": "1",
    }
    assert warm_memory.keep_bytes() >= 256 * 2**20
    assert env["PATH"] == "/bin"


def test_a_users_own_tunables_and_the_switch_are_respected():
    own = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert warm_memory.with_tunables(own) == own
    off = {warm_memory.ENV_SWITCH: "0"}
    assert warm_memory.with_tunables(off) == off


@linux_only
def test_the_cli_reexecution_and_blas_exec_set_them():
    assert "GLIBC_TUNABLES" in blas.preload_env({})
    assert blas.preload_env({warm_memory.ENV_SWITCH: "off"}).get("GLIBC_TUNABLES") is None
    code = "import os; print(os.environ.get('GLIBC_TUNABLES', ''))"
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "mlx_kvserve.cpu.blas_exec", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert done.stdout.strip() == warm_memory.tunables()


CHILD = """
import json, resource, threading
import mlx.core as mx
out = []
def run():
    blocks = [[mx.random.normal((1, 4, 128, 128)) for _ in range(32)] for _ in range(16)]  # 16 layers, 4096 tokens
    mx.eval(blocks)
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cache = [mx.concatenate(layer, axis=2) for layer in blocks]  # 8 MiB each, 128 MiB in all
        mx.eval(cache)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del cache
t = threading.Thread(target=run); t.start(); t.join()
print(json.dumps(out), flush=True)
import os; os._exit(0)
"""


def faults_per_assembly(env: dict[str, str]) -> list[int]:
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@linux_only
def test_a_freed_prefix_leaves_its_pages_for_the_next_one():
    """The same assembly four times, each freed before the next: with the tunables the later ones write
    into the pages the first one faulted in; with glibc's defaults each faults its 128 MiB in again."""
    import os

    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    warm = faults_per_assembly(warm_memory.with_tunables(base))
    cold = faults_per_assembly(base)
    pages = 128 * 2**20 // 4096
    assert warm[0] >= pages // 2 and cold[0] >= pages // 2  # the first one's pages are fresh in both
    assert max(warm[1:]) < pages // 16, warm
    assert min(cold[1:]) > pages // 4, cold  # glibc unmaps or trims (here 12289 of 32768 pages each time)
