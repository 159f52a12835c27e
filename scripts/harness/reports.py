"""Results of a bench: medians, the machine it ran on, and results.json + report.md in its output folder."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
from pathlib import Path


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_report(results: dict, out: Path, lines: list[str]) -> None:
    """results.json + report.md (the markdown `lines`) in `out`; prints the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    report = "\n".join(lines)
    (out / "report.md").write_text(report + "\n")
    print(report)


def version(dist: str) -> str | None:
    """An installed distribution's version, None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """Where a bench ran: platform, CPU model and count, memory, MLX's device and the packages' versions."""
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
    mem = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    device = str(mx.default_device())
    with contextlib.suppress(Exception):  # not every backend reports a name
        info = mx.device_info()
        device += f" ({info.get('device_name') or info.get('architecture') or ''})"
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": mem,
        "device": device,
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", None),
        **{dist.replace("-", "_"): version(dist) for dist in ("mlx-cpu", "mlx-lm", "mlx-kvserve")},
    }
