"""A test that fails with an Engine still running is reported and the test process exits: the
engine's worker and SSD writer threads are non-daemon (a shutdown drains the writer), so without
conftest's pytest_sessionfinish the process would wait for them forever and a CI run would hang."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_a_failing_engine_test_is_reported_and_the_process_exits():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "leaves_engine_running.py")]
    done = subprocess.run(cmd, cwd=TESTS.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # 1: tests failed (not a crash, not a hang)
    assert "1 failed" in done.stdout
    assert "failed before engine.stop()" in done.stdout
