"""Embeddings from a decoder model: the engine of a `[[models]]` entry with `kind = "embedding"`
(docs/models.md#embeddings), serving `/v1/embeddings`.

An embedding model is an mlx-lm model whose final hidden states (after its last norm: `model.model(x)`)
are pooled into one vector per input: the last token's state (what Qwen3-Embedding and most decoder
embedding models document) or the mean over the input's tokens, then L2-normalized unless the entry says
not to. It has no KV cache: each input is one forward pass, and nothing is kept.

Threads: like Engine, one thread (`mlx-embed`) owns this model's MLX work; callers submit token lists
through a bounded queue and get a concurrent Future back (exceptions are passed back as values). Inputs
are right-padded into batches: attention is causal, so a padded input's own positions never see the
padding and its vector equals the one it gets alone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidRequestError, ModelLoadError, OverloadedError, ShuttingDownError
from ..models.loader import LoadedModel

log = logging.getLogger(__name__)

POOLINGS = ("last", "mean")
BATCH_TOKENS = 8192  # padded tokens of one forward pass
MAX_BATCH = 64  # inputs of one forward pass
_STOP = object()


class Embedded(NamedTuple):
    """One request's vectors (float32, one row per input, in input order) and its tokens."""

    vectors: np.ndarray
    num_tokens: int


def inner_model(model: Any) -> Any:
    """The module that maps token ids to final (normed) hidden states: mlx-lm's `Model.model`, or the
    text model of a family that wraps one (`language_model.model`). ModelLoadError when there is none."""
    for owner in (model, getattr(model, "language_model", None)):
        inner = getattr(owner, "model", None)
        if inner is not None and hasattr(inner, "embed_tokens"):
            return inner
    raise ModelLoadError(f"cannot embed with {type(model).__module__}: no inner model with embed_tokens")


def hidden_size(config: dict[str, Any], inner: Any) -> int:
    """The size of the model's hidden states (its vectors): the config's `hidden_size` (also under
    `text_config`), else the embedding table's width (not packed: the model is not quantized)."""
    for where in (config, config.get("text_config") or {}):
        size = where.get("hidden_size")
        if isinstance(size, int) and size > 0:
            return size
    return int(inner.embed_tokens.weight.shape[-1])


def pool(hidden: Any, lengths: Sequence[int], pooling: str, normalize: bool) -> Any:
    """One float32 vector per row of `hidden` (B, L, H), whose row i holds `lengths[i]` real tokens
    followed by padding: the last real token's state ("last") or the mean of the real ones ("mean"),
    L2-normalized when `normalize`."""
    import mlx.core as mx

    hidden = hidden.astype(mx.float32)
    n = mx.array(list(lengths))
    if pooling == "last":
        pooled = hidden[mx.arange(hidden.shape[0]), n - 1]
    else:
        mask = (mx.arange(hidden.shape[1])[None, :] < n[:, None]).astype(mx.float32)
        pooled = (hidden * mask[..., None]).sum(axis=1) / n[:, None].astype(mx.float32)
    if normalize:
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


def batches(lengths: Sequence[int], max_tokens: int = BATCH_TOKENS, max_batch: int = MAX_BATCH) -> list[list[int]]:
    """Input indices grouped for forward passes: by length (less padding), each group's padded size
    (count x longest) at most `max_tokens` (a longer input goes alone)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        group = groups[-1] if groups else None
        if group is not None and len(group) < max_batch and (len(group) + 1) * lengths[i] <= max_tokens:
            group.append(i)
        else:
            groups.append([i])
    return groups


def fit_dimensions(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first `dimensions` of each vector (Matryoshka truncation), renormalized when the model
    normalizes; unchanged for None. The caller checked `dimensions` (check_dimensions)."""
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    if normalize:
        cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut.astype(np.float32)


def check_dimensions(dimensions: int | None, native: int, min_dimensions: int, name: str) -> None:
    """InvalidRequestError (400) for a `dimensions` this model cannot give: it gives its own size, and
    sizes down to `min_dimensions` when its entry declares them (0: none)."""
    if dimensions is None or dimensions == native:
        return
    if min_dimensions and min_dimensions <= dimensions < native:
        return
    allowed = f"from {min_dimensions} to {native}" if min_dimensions else f"only {native} (its own size)"
    raise InvalidRequestError(
        f"model {name!r} cannot give {dimensions}-dimension embeddings: 'dimensions' may be {allowed}",
        param="dimensions",
    )


class EmbeddingEngine:
    """The engine of an embedding model (see the module docstring). Looks like Engine where the
    server and the registry read it (health, stats, stop); serves only `embed`."""

    is_embedding = True

    def __init__(
        self, loaded: LoadedModel, config: Any, pooling: str = "last", normalize: bool = True, min_dimensions: int = 0
    ):
        if pooling not in POOLINGS:
            raise ModelLoadError(f"pooling {pooling!r} is not one of {POOLINGS}")
        self.loaded, self.config = loaded, config
        self.pooling, self.normalize, self.min_dimensions = pooling, normalize, min_dimensions
        self.inner = inner_model(loaded.model)
        self.dimensions = hidden_size(loaded.config, self.inner)
        self._queue: queue.Queue = queue.Queue(maxsize=config.server.max_queue)
        self._lock = threading.Lock()  # guards _closing, _busy and the counters below
        self._closing = False
        self._busy = False
        self.num_inputs = self.num_tokens = 0
        self.embed_s = 0.0
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._loop, name="mlx-embed", daemon=True)

    # --- what the server reads -------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        return int(self.inner.embed_tokens.weight.shape[0])  # rows: also of a quantized embedding

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    failure = ""  # an embedding batch that fails fails its request only
    leases_active = keeps_checkpoints = False

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def is_busy(self) -> bool:
        with self._lock:
            return self._busy

    def ssd_problem(self) -> str:
        return ""

    def text_tokens(self, text: str) -> list[int]:
        """`text`'s ids as the model's tokenizer encodes it (with the special tokens it adds: Qwen3-
        Embedding's appends the end-of-text token its last-token pooling reads)."""
        return list(self.loaded.tokenizer.encode(text))

    def batch_stats(self) -> dict[str, Any]:
        with self._lock:
            busy, tokens, seconds, inputs = self._busy, self.num_tokens, self.embed_s, self.num_inputs
        return {
            "running": int(busy),
            "waiting": self.queue_depth,
            "batch_size": 0,
            "max_batch": MAX_BATCH,
            "prefill_tokens": tokens,
            "prefill_s": round(seconds, 3),
            "prefill_tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
            "decode_tokens": 0,
            "decode_s": 0.0,
            "decode_tokens_per_s": 0.0,
            "shared_prefix_waits": 0,
            "embedded_inputs": inputs,
        }

    def cache_stats(self) -> dict[str, Any]:
        return {"enabled": False, "reason": "an embedding model keeps no KV cache"}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "kind": "embedding",
            "uptime_s": round(time.time() - self.started_at, 1),
            "queue_depth": self.queue_depth,
            "busy": self.is_busy,
            "batch": self.batch_stats(),
            "context_length": self.context_length,
            "dimensions": self.dimensions,
            "pooling": self.pooling,
            "cache": self.cache_stats(),
        }

    # --- life and work ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, fail what is queued (ShuttingDownError), end the thread after its batch."""
        with self._lock:
            self._closing = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[1].set_exception(ShuttingDownError("server is shutting down"))
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def embed(self, inputs: list[list[int]]) -> Future:
        """A Future of Embedded for these token lists (each non-empty, checked by the caller). Never
        blocks: OverloadedError (429) when max_queue requests wait, ShuttingDownError after stop."""
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise ShuttingDownError("server is shutting down")
            try:
                self._queue.put_nowait((inputs, future))
            except queue.Full:
                raise OverloadedError(f"too many requests waiting ({self._queue.maxsize}); retry shortly") from None
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            inputs, future = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._busy = True
            started = time.monotonic()
            try:
                future.set_result(self._run(inputs))
            except Exception as exc:  # the request fails, the thread goes on
                log.exception("embedding batch failed")
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._busy = False
                    self.embed_s += time.monotonic() - started

    def _run(self, inputs: list[list[int]]) -> Embedded:
        """Every input's vector (on this thread: it owns the model's MLX work)."""
        import mlx.core as mx

        lengths = [len(tokens) for tokens in inputs]
        out = np.zeros((len(inputs), self.dimensions), dtype=np.float32)
        for group in batches(lengths):
            width = max(lengths[i] for i in group)
            padded = [inputs[i] + [0] * (width - lengths[i]) for i in group]
            pooled = pool(self.inner(mx.array(padded)), [lengths[i] for i in group], self.pooling, self.normalize)
            mx.eval(pooled)
            out[group] = np.array(pooled)
        with self._lock:
            self.num_inputs += len(inputs)
            self.num_tokens += sum(lengths)
        return Embedded(out, sum(lengths))
