"""A serving process ends with its own status after its shutdown, never with MLX's teardown abort
(mlx_kvserve/clean_exit.py): threads still busy in MLX when the interpreter ends made the process die
with "terminate called without an active exception" (SIGABRT) in most runs of this child without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    import mlx.core as mx
    from mlx_kvserve.clean_exit import serve_then_exit

    def spin():  # a daemon thread still computing in MLX when the process ends
        a = mx.random.normal((256, 256))
        while True:
            a = (a @ a) * 1e-3
            mx.eval(a)

    def finish_late(path):  # a non-daemon thread (an SSD writer draining): waited for
        time.sleep(0.5)
        Path(path).write_text("done")

    for _ in range(2):
        threading.Thread(target=spin, daemon=True).start()
    threading.Thread(target=finish_late, args=(sys.argv[1],)).start()
    time.sleep(0.3)

    def serve():
        print("served", flush=True)
        if sys.argv[2] != "0":
            raise SystemExit(int(sys.argv[2]))

    serve_then_exit(serve, before_exit=lambda: print("before exit", flush=True))
    """
)


def run_child(tmp_path, code: int) -> tuple[subprocess.CompletedProcess, str]:
    marker = tmp_path / f"late-{code}"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(marker), str(code)], capture_output=True, text=True, timeout=120
    )
    return proc, marker.read_text() if marker.exists() else ""


def test_the_process_ends_with_its_status_while_threads_still_compute(tmp_path):
    for attempt in range(3):
        proc, late = run_child(tmp_path, 0)
        assert proc.returncode == 0, (attempt, proc.returncode, proc.stderr[-2000:])
        assert proc.stdout.split() == ["served", "before", "exit"]
        assert "terminate called" not in proc.stderr
        assert late == "done"  # the non-daemon thread finished before the process ended


def test_a_system_exit_keeps_its_status(tmp_path):
    proc, late = run_child(tmp_path, 3)
    assert proc.returncode == 3 and late == "done", proc.stderr[-2000:]
