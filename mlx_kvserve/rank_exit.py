"""How the ranks of a distributed server leave once `mlx.launch` is stopped.

mlx.launch forwards no signal to its ranks: stopped (SIGTERM, SIGKILL), it dies and leaves them
running as orphans, rank 0 still holding the HTTP port and every rank its cache folder's lock, so
the next launch fails. And a follower cannot leave the lockstep alone, so it ignores a stop signal
until rank 0 stops. So every rank:

- watches its parent (the launcher, or the ssh session that started it): once the parent is gone,
  the rank stops as if it got SIGTERM; rank 0 then shuts down gracefully, and the stop reaches the
  followers with the next update;
- once told to stop (that, or SIGTERM / SIGINT / SIGHUP), exits within `grace_s` whatever happens:
  a rank whose peer hung stays blocked in a collective, which Python cannot interrupt, so a timer
  ends the process (`os._exit`) and the OS releases its folder locks. Blocks already on disk are
  whole (a temp file, then a rename); those still queued are lost: a later miss, never a wrong
  answer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

GRACE_MARGIN_S = 10.0  # beyond the shutdown and drain timeouts, before a stopping rank is ended
PARENT_POLL_S = 0.2


class RankExit:
    """The stop bound of one rank. `deadline(why)` arms it (once; later calls do nothing);
    `watch_parent(on_gone, parent)` calls `on_gone` once, on a daemon thread, when the parent is gone."""

    def __init__(self, rank: int, grace_s: float):
        self.rank = rank
        self.grace_s = grace_s
        self._lock = threading.RLock()  # guards _timer; re-entrant: a signal handler may call in
        self._timer: threading.Timer | None = None

    def deadline(self, why: str) -> None:
        with self._lock:
            if self._timer is not None:
                return
            log.warning("rank %d: %s: stopping (at most %.0f s more)", self.rank, why, self.grace_s)
            self._timer = threading.Timer(self.grace_s, self._expire, args=(why,))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, why: str) -> None:
        log.error(
            "rank %d: still running %.0f s after %s (blocked in a collective?): exiting", self.rank, self.grace_s, why
        )
        os._exit(1)

    def watch_parent(self, on_gone: Callable[[], None], parent: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
        """`parent`: the pid this process had as parent at its start (a parent gone before the
        watch begins counts too)."""

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            on_gone()

        thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
        thread.start()
        return thread


def guard_rank(rank: int, stop_s: float, parent: int) -> RankExit:
    """Wire the stop of this rank, whose graceful stop takes up to `stop_s` (the requests in flight,
    then the SSD writer's drain); `parent`: the launcher's pid, read at the process's start. A follower cannot stop alone (the ranks run in lockstep): on
    SIGTERM, SIGINT or SIGHUP, or once the launcher is gone, it goes on until rank 0's stop
    arrives or rank 0 is gone (its next collective fails), then drains its SSD writer. Rank 0
    stops gracefully (its own SIGTERM, which uvicorn handles with SIGINT) when the launcher is
    gone or on SIGHUP. Either way the rank ends `stop_s + GRACE_MARGIN_S` later at the latest."""
    rank_exit = RankExit(rank, stop_s + GRACE_MARGIN_S)
    if rank != 0:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda signum, _: rank_exit.deadline(signal.Signals(signum).name))
        rank_exit.watch_parent(lambda: rank_exit.deadline("the launcher is gone"), parent)
        return rank_exit

    def stop_gracefully(why: str) -> None:
        rank_exit.deadline(why)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGHUP, lambda *_: stop_gracefully("SIGHUP"))
    rank_exit.watch_parent(lambda: stop_gracefully("the launcher is gone"), parent)
    return rank_exit
