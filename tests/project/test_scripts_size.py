"""scripts/ stays a handful of maintained entry points (issue 48): at most 8 entry scripts (every .py and .sh at
the top of scripts/: the Python entry points, gpu_run.sh and `make setup`'s install.sh; scripts/harness/ is their
shared code, not an entry) and at most 6,000 lines of .py and .sh in all, harness included. An investigation
retires to git history once its figure is in docs/benchmarks*.md; docs/benchmarks.md stays a reference."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
MAX_ENTRY_SCRIPTS, MAX_LINES, MAX_REFERENCE_LINES = 8, 6000, 400


def entry_scripts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in {".py", ".sh"})


def script_lines(folder: Path) -> int:
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix in {".py", ".sh"}]
    return sum(len(p.read_text().splitlines()) for p in files if "__pycache__" not in p.parts)


def test_scripts_has_at_most_8_entry_points_and_6000_lines():
    entries = entry_scripts(SCRIPTS)
    assert len(entries) <= MAX_ENTRY_SCRIPTS, f"{len(entries)} entry scripts: {entries}; add a scenario instead"
    lines = script_lines(SCRIPTS)
    assert lines <= MAX_LINES, f"scripts/ holds {lines} lines (> {MAX_LINES}): retire an investigation to git history"


def test_the_count_sees_entries_and_harness_lines(tmp_path):
    (tmp_path / "harness" / "sub").mkdir(parents=True)
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "b.sh").write_text("echo hi\n")
    (tmp_path / "notes.md").write_text("not code\n")
    (tmp_path / "harness" / "sub" / "c.py").write_text("z = 3\n" * 5)
    assert entry_scripts(tmp_path) == ["a.py", "b.sh"]
    assert script_lines(tmp_path) == 2 + 1 + 5


def test_the_benchmark_reference_stays_short():
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_REFERENCE_LINES, f"docs/benchmarks.md is {lines} lines: move session history to a dated file"
