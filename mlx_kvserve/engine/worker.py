"""The one thread that owns MLX. Requests come in through a bounded queue; events go out through
each request's `emit`. A failure in one request becomes a Failed event and the worker goes on."""

from __future__ import annotations

import logging
import queue
import threading

from ..errors import OverloadedError, ShuttingDownError
from .generate import Generator
from .request import Failed, Finished, GenerationRequest, Usage

log = logging.getLogger(__name__)
_STOP = object()  # sentinel: always the last item the worker reads


class InferenceWorker:
    """Owns the Generator (and so MLX) on a single thread.

    `submit` never blocks: it raises OverloadedError when `max_queue` requests already wait and
    ShuttingDownError after `stop`. `stop` cancels what is queued, lets the running request end
    at its next token, and joins the thread.
    """

    def __init__(self, generator: Generator, max_queue: int):
        self.generator = generator
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards _closing and _current
        self._closing = False
        self._current: GenerationRequest | None = None
        self._thread = threading.Thread(target=self._loop, name="mlx-worker", daemon=False)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread runs (False before start, after stop, or if it died)."""
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def is_busy(self) -> bool:
        with self._lock:
            return self._current is not None

    def submit(self, req: GenerationRequest) -> None:
        with self._lock:
            if self._closing:
                raise ShuttingDownError("server is shutting down")
            try:
                self._queue.put_nowait(req)
            except queue.Full:
                raise OverloadedError(f"too many requests waiting ({self._queue.maxsize}); retry shortly") from None

    def stop(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closing = True
            if self._current is not None:
                self._current.cancel()
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

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            with self._lock:
                self._current = item
            try:
                if item.cancelled.is_set():
                    item.emit(Finished("cancelled", Usage(len(item.prompt_tokens), 0), 0.0))
                else:
                    self.generator.run(item)
            except Exception as exc:  # passed back as a value; the worker keeps serving
                log.exception("request %s failed", item.request_id)
                item.emit(Failed(exc))
            finally:
                with self._lock:
                    self._current = None
                if item.on_done is not None:
                    item.on_done()
