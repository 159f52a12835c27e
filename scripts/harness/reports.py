"""Results of a bench: medians, and results.json + report.md in its output folder."""

from __future__ import annotations

import json
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
