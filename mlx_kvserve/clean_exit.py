"""Ending a serving process once its shutdown is done, without the interpreter's teardown.

MLX keeps per-thread streams whose C++ objects outlive the interpreter when a process ends the normal
way; with threads that used MLX still alive at exit (the thread pool that loaded models, daemon
threads), that teardown can abort the process after a clean shutdown ("terminate called without an
active exception", killed by SIGABRT): a service manager then sees a crash, and a test its exit
status -6. MLX's maintainers ask for `mx.clear_streams()` at the end of every thread that used MLX; a
server cannot end its thread pool's threads, so once the shutdown is done (the workers stopped, the SSD
writers drained, the indexes written, uvicorn returned), `serve_then_exit` waits for the non-daemon
threads as Python's own exit would (an SSD writer still saving past its drain limit finishes: nothing
queued is dropped), flushes the logs and the standard streams, and ends the process with `os._exit`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_code(exc: SystemExit) -> int:
    """The status a SystemExit asks for, as Python's own exit computes it (a message: 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def serve_then_exit(serve: Callable[[], None], before_exit: Callable[[], None] | None = None) -> NoReturn:
    """Run `serve` (it returns, or raises SystemExit, when the server has shut down), then
    `before_exit`, then end the process with `serve`'s status. Another exception propagates as usual."""
    try:
        serve()
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    finally:
        if before_exit is not None:
            before_exit()
    end_process(code)


def end_process(code: int) -> NoReturn:
    """Wait for the non-daemon threads, flush, and `os._exit(code)`."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing more can be said there
            pass
    os._exit(code)
