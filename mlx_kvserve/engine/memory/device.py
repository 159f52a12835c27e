"""The memory the model's arrays live in, and MLX's hold on it.

On a Mac (Metal, unified memory) and on the CPU, MLX's arrays live in the system's memory. With MLX's
CUDA backend they live in the GPU's own memory, which is smaller than the host's, and MLX's allocator
keeps freed buffers for reuse up to its memory limit (80% of the GPU): a long-running server's buffer
cache can then hold what a neighbour process, or its own next prefill, needs, and a step fails with
"cudaMallocAsync ... out of memory" (seen on an H100 beside `mlx_lm.server`: docs/benchmarks.md "GPU").
So on such a device the memory defaults are sized from the GPU's memory, MLX's buffer cache is bounded
([server] mlx_cache_limit_bytes), and a step that ran out of memory hands the cached buffers back
before the next one (engine/batch/scheduler.py). /health reports these figures (memory_report).
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx

log = logging.getLogger(__name__)

# MLX and its backends word an allocation failure like this: CUDA "cudaMallocAsync(...) failed: out of
# memory", Metal "[metal::malloc] Resource limit (...) exceeded" / "Insufficient Memory", the CPU
# allocator "[malloc] Unable to allocate ...".
OUT_OF_MEMORY_MARKS = ("out of memory", "insufficient memory", "unable to allocate", "resource limit")

_cache_limit: int | None = None  # what bound_buffer_cache set (MLX has no getter); None: MLX's default
_failures = {"count": 0, "last": ""}  # requests failed for want of memory since the start (for /health)


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def arrays_in_device_memory() -> bool:
    """Whether MLX's arrays live in a GPU's own memory (CUDA), apart from the system's."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def array_memory_bytes() -> int:
    """Bytes of the memory the arrays live in: the GPU's own with CUDA, the system's elsewhere."""
    if arrays_in_device_memory():
        info = mx.device_info()
        total = info.get("total_memory") or info.get("memory_size")
        if isinstance(total, int) and total > 0:
            return total
    return physical_memory_bytes()


def bound_buffer_cache(limit_bytes: int) -> int | None:
    """Bound MLX's cache of freed buffers (process-wide): `limit_bytes`, or when 0 a quarter of a GPU's
    own memory (CUDA) and MLX's default elsewhere. The limit set, or None when MLX's default stays."""
    global _cache_limit
    if limit_bytes <= 0:
        if not arrays_in_device_memory():
            return None
        limit_bytes = array_memory_bytes() // 4
    mx.set_cache_limit(limit_bytes)
    if _cache_limit != limit_bytes:
        log.info("MLX buffer cache bounded to %.2f GiB", limit_bytes / 1024**3)
    _cache_limit = limit_bytes
    return limit_bytes


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(mark in text for mark in OUT_OF_MEMORY_MARKS)


def release_after_out_of_memory(exc: BaseException) -> bool:
    """After a failure: when it was an allocation failure, hand MLX's cached buffers back (they may be
    what the next step needs) and log where the memory is. Whether it was one."""
    if not is_out_of_memory(exc):
        return False
    before = mx.get_cache_memory()
    mx.clear_cache()
    _failures["count"] += 1
    _failures["last"] = message = (str(exc).splitlines() or [""])[0][:200]
    log.warning(
        "out of memory (%s): released %.2f GiB of MLX's cached buffers; in use %.2f GiB of %.2f GiB",
        message,
        before / 1024**3,
        mx.get_active_memory() / 1024**3,
        array_memory_bytes() / 1024**3,
    )
    return True


def memory_report() -> dict:
    """MLX's memory figures for /health: where the arrays live and how much each part holds."""
    return {
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "separate_device_memory": arrays_in_device_memory(),
        "total_bytes": array_memory_bytes(),
        "active_bytes": mx.get_active_memory(),
        "buffer_cache_bytes": mx.get_cache_memory(),
        "buffer_cache_limit_bytes": _cache_limit,  # None: MLX's default (its memory limit)
        "peak_bytes": mx.get_peak_memory(),
        "requests_failed_out_of_memory": _failures["count"],
        "last_out_of_memory": _failures["last"] or None,
    }


# Metal's wired limit (engine/memory/plan.py): the plan's, and the one before it, restored at exit.
_wired: dict[str, int | None] = {"planned": None, "before": None}


def wire(limit_bytes: int) -> None:
    """On Metal, keep `limit_bytes` wired (the plan's weights + KV budgets); elsewhere nothing. The limit
    before the first call is kept for `unwire`."""
    if limit_bytes <= 0 or not mx.metal.is_available():
        return
    previous = mx.set_wired_limit(limit_bytes)
    if _wired["before"] is None:
        _wired["before"] = previous
    _wired["planned"] = limit_bytes
    log.info("Metal wired limit set to %.2f GiB (the memory plan)", limit_bytes / 1024**3)


def rewire() -> None:
    """The plan's wired limit again: mlx-lm's BatchGenerator sets the recommended working set when it
    is built (and puts the one before back when it closes)."""
    if _wired["planned"] is not None:
        mx.set_wired_limit(_wired["planned"])


def unwire() -> None:
    """The wired limit as it was before `wire` (at exit)."""
    if _wired["before"] is not None:
        mx.set_wired_limit(_wired["before"])
        log.info("Metal wired limit restored to %.2f GiB", _wired["before"] / 1024**3)
    _wired["planned"] = _wired["before"] = None
