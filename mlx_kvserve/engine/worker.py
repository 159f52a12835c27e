"""The one thread that owns MLX. Requests come in through a bounded queue; events go out through
each request's `emit`. A failure in one request becomes a Failed event and the worker goes on."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from ..errors import OverloadedError, ShuttingDownError
from .batch.scheduler import Scheduler
from .batch.step_turns import StepTurns
from .request import Failed, Finished, GenerationRequest, Usage

log = logging.getLogger(__name__)
_STOP = object()  # sentinel: always the last item the worker reads


class InferenceWorker:
    """Owns the Scheduler (and so MLX) on a single thread, serving requests as one batch.

    `submit` never blocks: it raises OverloadedError when `max_queue` requests already wait and
    ShuttingDownError after `stop`. Between batch steps the thread moves waiting requests into the
    batch while it has room (`Scheduler.max_batch`). `stop` cancels what is queued, lets the
    running requests end at their next token, and joins the thread.
    """

    def __init__(self, scheduler: Scheduler, max_queue: int):
        self.scheduler = scheduler
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards _closing and _running
        self._closing = False
        self._running: dict[int, GenerationRequest] = {}  # admitted, not finished, by id()
        self._idle_task: Callable[[], bool] | None = None  # read and cleared on the worker thread only
        # Turns shared with other engines' workers (engine/batch/step_turns.py); None: steps run when ready.
        self.turns: StepTurns | None = None
        self._thread = threading.Thread(target=self._loop, name="mlx-worker", daemon=False)

    def start(self, idle_task: Callable[[], bool] | None = None) -> None:
        """Start the thread. `idle_task` (e.g. the SSD prefetch) runs on it in small steps while no
        request runs or waits; it returns False once it has nothing more to do."""
        self._idle_task = idle_task
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread runs (False before start, after stop, or if it died)."""
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Requests waiting to join the batch (queued here, or admitted and not yet started)."""
        return self._queue.qsize() + self.scheduler.num_pending

    @property
    def num_running(self) -> int:
        """Requests in the batch (prefilling or decoding; not those still pending in the scheduler)."""
        with self._lock:
            return max(0, len(self._running) - self.scheduler.num_pending)

    @property
    def is_busy(self) -> bool:
        with self._lock:
            return bool(self._running)

    def submit(self, req: GenerationRequest) -> None:
        with self._lock:
            if self._closing:
                raise ShuttingDownError("server is shutting down")
            try:
                if self.queue_depth >= self._queue.maxsize:  # queued plus pending in the scheduler
                    raise queue.Full
                self._queue.put_nowait(req)
            except queue.Full:
                raise OverloadedError(f"too many requests waiting ({self._queue.maxsize}); retry shortly") from None

    def stop(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closing = True
            self._cancel_running()
        while True:  # cancel everything still queued so no client waits forever
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, GenerationRequest):
                item.emit(Finished("cancelled", Usage(len(item.prompt_tokens), 0), 0.0))
                if item.on_done is not None:
                    item.on_done()
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _cancel_running(self) -> None:
        """Stop the running requests at their next token. Lock held."""
        for req in self._running.values():
            req.cancel()

    def _loop(self) -> None:
        stopping = False
        while True:
            busy = self.scheduler.has_work
            while not stopping and not self.scheduler.is_full:
                try:  # block only when nothing runs and no idle work is left
                    item = self._queue.get_nowait() if busy or self._idle_task else self._queue.get()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                self._admit(item)
                busy = self.scheduler.has_work
            if not busy and stopping:
                self.scheduler.close()
                return
            if busy:
                self._step()
            elif self._idle_task is not None and not stopping:
                self._idle_step()

    def _idle_step(self) -> None:
        """One step of the idle task; it ends when it says so or fails (logged, never fatal)."""
        try:
            more = self._idle_task()
        except Exception:
            log.exception("idle task failed; stopped")
            more = False
        if not more:
            self._idle_task = None

    def _admit(self, req: GenerationRequest) -> None:
        on_done = req.on_done

        def done() -> None:  # the scheduler calls it once the request is over, KV registered
            with self._lock:
                self._running.pop(id(req), None)
            if on_done is not None:
                on_done()

        req.on_done = done
        with self._lock:
            self._running[id(req)] = req
            if self._closing:
                req.cancel()
        try:
            self.scheduler.admit(req)
        except Exception as exc:  # admit sends its own failures; this is a bug, kept from the others
            log.exception("request %s failed", req.request_id)
            req.emit(Failed(exc))
            done()

    def _step(self) -> None:
        turns = self.turns
        try:
            if turns is None:
                self.scheduler.step()
            else:
                with turns.turn():
                    self.scheduler.step()
        except Exception:  # step fails requests itself; never let the thread die
            log.exception("batch step failed")
