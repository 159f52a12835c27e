"""Shared pieces of the benchmark scripts: prompts, the model folder, medians."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "islands", "volcanoes", "glaciers", "lakes", "valleys"]


def system_prompt(nonce: str = "", target_words: int = 880) -> str:
    """A ~1.2k-token system prompt (SmolLM2 tokenizer); `nonce` makes it unique (a cold prompt)."""
    lines = [f"Session {nonce}." if nonce else "Session.", "You are a careful geography tutor. Follow these rules:"]
    i, words = 0, 0
    while words < target_words:
        topic = TOPICS[i % len(TOPICS)]
        line = f"Rule {i + 1}: when asked about {topic}, give one precise fact, name a real example, and keep the answer short."
        lines.append(line)
        words += len(line.split())
        i += 1
    return "\n".join(lines)


QUESTIONS = [
    "What is the capital of France?",
    "Name a large desert in Africa.",
    "Which ocean is the largest?",
    "What is the highest mountain on Earth?",
]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def default_model_dir() -> Path:
    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.default import ensure_default_model

    return ensure_default_model(default_home() / "models", "float32")


def write_report(results: dict, out: Path, lines: list[str]) -> None:
    """results.json + report.md (the markdown `lines`) in `out`; prints the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    report = "\n".join(lines)
    (out / "report.md").write_text(report + "\n")
    print(report)
