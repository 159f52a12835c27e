"""Blocks <-> mlx-lm prompt cache. The only module that knows mlx-lm's cache classes.

A model's cache is a list of per-layer caches; `cache_layout` tells each layer's kind:

- full attention (`KVCache`): every position's keys and values, cut into blocks;
- sliding window (`RotatingKVCache`, window W): only the last W positions matter for what comes
  next. A block holds this layer's KV for the part of the block that was still inside some
  window when the block was registered (a suffix of the block, possibly empty);
- recurrent / linear attention (`ArraysCache`): a fixed-size state with no per-position data.
  It is kept only as a checkpoint: the state after exactly P tokens, stored with the tail that
  ends at P;
- a layer this process does not run (pipeline parallel: another rank holds it): nothing.
What a block holds per layer (a payload): kv/payloads.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, RotatingKVCache, make_prompt_cache

from . import kvquant, runs
from .cache_fill import fill_direct, fill_kv
from .concat import join_pair
from .payloads import (
    IDLE,
    KV,
    STATE,
    WINDOW,
    LayerSpec,
    Payload,
    arrays_of,
    kv_dtype_of,
    payload_from_arrays,
    payload_nbytes,
    payload_to_arrays,
    window_pieces,
)


@dataclass(frozen=True)
class Capture:
    """What the cache held right after its first `position` tokens: per layer, a recurrent
    state (STATE layers) or the window's positions in order, `(first, keys, values)` covering
    positions first..position-1 (WINDOW layers); None for full-attention layers."""

    position: int
    layers: tuple[Any, ...]


def _owned(a: mx.array) -> mx.array:
    """A copy that owns its memory (a slice of a batch's cache would keep the whole batch alive)."""
    return mx.array(a) if a.size else a


class CacheLayout:
    """A model's per-layer cache kinds and the operations on its blocks, tails and checkpoints.
    `supported` False: block caching stays off for this model and `reason` says why."""

    def __init__(
        self, model: Any, specs: Sequence[LayerSpec], reason: str, kv_dtype: str, block_size: int, kv_bits: int = 0
    ):
        self.model = model
        self.block_size = block_size
        self.specs = tuple(specs)
        self.reason = reason
        self.kv_dtype = kv_dtype
        # Quantized KV (kv/kvquant.py): full-attention layers round every key and value as it enters
        # the cache, and blocks store them as (integers, exponents) per keys and values.
        self.kv_bits = kv_bits
        self._rounded = _rounded_caches(kv_bits) if kv_bits else None

    @property
    def supported(self) -> bool:
        return not self.reason

    @property
    def has_state(self) -> bool:
        return any(s.kind == STATE for s in self.specs)

    @property
    def has_window(self) -> bool:
        return any(s.kind == WINDOW for s in self.specs)

    @property
    def exact_tails(self) -> bool:
        """Tails carry recurrent states at their very end: usable only whole."""
        return self.has_state

    @property
    def needs_checkpoints(self) -> bool:
        """Whether a prefix is usable only where something was captured (see `usable`)."""
        return self.has_state or self.has_window

    @property
    def signature(self) -> str:
        """The layout in the cache's namespace ("" for all-full-attention models, whose
        namespace predates layouts), so a cache written for one layout is never read for another."""
        quant = f"|kv_bits={self.kv_bits}" if self.kv_bits else ""
        if all(s.kind == KV for s in self.specs):
            return quant.removeprefix("|")
        return ",".join(f"{s.kind}{s.window or s.state_size or ''}" for s in self.specs) + quant

    def describe(self) -> dict[str, int]:
        """Layers per kind (for /health)."""
        out: dict[str, int] = {}
        for s in self.specs:
            key = f"{s.kind}{s.window}" if s.kind == WINDOW else s.kind
            out[key] = out.get(key, 0) + 1
        return out

    # --- reading a live cache -------------------------------------------------------------------

    def new_cache(self) -> list[Any]:
        """An empty prompt cache for this model (full-attention layers rounding with kv_bits)."""
        cache = make_prompt_cache(self.model)
        if self._rounded is not None:
            rounded = self._rounded[0]
            cache = [rounded() if spec.kind == KV else c for spec, c in zip(self.specs, cache, strict=True)]
        return cache

    def cache_length(self, prompt_cache: list[Any]) -> int | None:
        """How many tokens the cache holds; None when no layer counts them (recurrent only)."""
        for spec, c in zip(self.specs, prompt_cache, strict=True):
            if spec.kind in (KV, WINDOW):
                return c.offset
        return None

    def capture(self, prompt_cache: list[Any], position: int) -> Capture:
        """Copy what a checkpoint at `position` (= the cache's length now) needs."""
        layers: list[Any] = []
        for spec, c in zip(self.specs, prompt_cache, strict=True):
            if spec.kind == STATE:
                complete = all(a is not None for a in c.cache)
                layers.append(tuple(_owned(a) for a in c.cache) if complete else None)
            elif spec.kind == WINDOW:
                first, k, v = _window_range(c)
                layers.append((first, _owned(k), _owned(v)))
            else:  # full attention (the cache keeps every position) or a layer not run here
                layers.append(None)
        arrays = [a for entry in layers if entry for a in entry if isinstance(a, mx.array)]
        mx.eval(arrays)
        return Capture(position, tuple(layers))

    def _window_sources(self, prompt_cache: list[Any], captures: Sequence[Capture], layer: int) -> list[tuple]:
        """(first, end, keys, values) of every range of this window layer's positions we have."""
        first, k, v = _window_range(prompt_cache[layer])
        sources = [(first, first + k.shape[2], k, v)]
        for cap in captures:
            f, ck, cv = cap.layers[layer]
            sources.append((f, f + ck.shape[2], ck, cv))
        return sources

    def _window_part(self, sources: list[tuple], lo: int, hi: int) -> tuple[mx.array, mx.array] | None:
        """The longest suffix of positions lo..hi-1 some source holds, or None."""
        best = None
        for first, end, k, v in sources:
            if end >= hi and first < hi and (best is None or first < best[0]):
                best = (first, k, v)
        if best is None:
            return None
        first, k, v = best
        a = max(lo, first)
        return mx.contiguous(k[..., a - first : hi - first, :]), mx.contiguous(v[..., a - first : hi - first, :])

    def slice_blocks(
        self, prompt_cache: list[Any], start: int, end: int, block_size: int, captures: Sequence[Capture] = ()
    ) -> list[tuple[Payload, int]]:
        """Copy blocks start..end-1 (block indices) out of the cache: [(payload, nbytes)]: full-attention layers
        once (a run each block's entries are views of, kv/runs.py), window layers what the cache or a capture holds."""
        runs.compact_pending(block_size)
        first, last = start * block_size, end * block_size
        run = runs.Run(
            [
                self._kv_entry(c.keys[..., first:last, :], c.values[..., first:last, :]) if spec.kind == KV else None
                for spec, c in zip(self.specs, prompt_cache, strict=True)
            ],
            end - start,
        )
        parts = {i: runs.split(entry, end - start) for i, entry in enumerate(run.layers) if entry is not None}
        windows = {
            i: self._window_sources(prompt_cache, captures, i) for i, s in enumerate(self.specs) if s.kind == WINDOW
        }
        out = []
        for b in range(start, end):
            lo, hi = b * block_size, (b + 1) * block_size
            payload: Payload = []
            for i, spec in enumerate(self.specs):
                if spec.kind == KV:
                    payload.append(parts[i][b - start])
                elif spec.kind == WINDOW:
                    payload.append(self._window_part(windows[i], lo, hi))
                else:  # recurrent (kept with tails only) or not run here
                    payload.append(None)
            out.append(runs.RunPayload(payload, run, lo - first))
        mx.eval([a for p in out for i in windows if p[i] is not None for a in p[i]])  # split() evaluated its views
        return [(p, payload_nbytes(p)) for p in out]

    def slice_tail(
        self,
        prompt_cache: list[Any],
        start: int,
        end: int,
        state: Capture | None = None,
        captures: Sequence[Capture] = (),
    ) -> tuple[Payload, int]:
        """Copy positions start..end-1 (a tail) out of the cache, with the recurrent state of
        `state` (a capture at `end`) when given: (payload, nbytes)."""
        payload: Payload = []
        for i, (spec, c) in enumerate(zip(self.specs, prompt_cache, strict=True)):
            if spec.kind == KV:
                payload.append(self._kv_entry(c.keys[..., start:end, :], c.values[..., start:end, :]))
            elif spec.kind == WINDOW:
                payload.append(self._window_part(self._window_sources(prompt_cache, captures, i), start, end))
            elif spec.kind == STATE:
                payload.append(state.layers[i] if state is not None else None)
            else:
                payload.append(None)
        mx.eval(arrays_of([payload]))
        return payload, payload_nbytes(payload)

    def _kv_entry(self, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        """A full-attention layer's part of a block: (keys, values), or with kv_bits their
        (integers, exponents) each: exact, since the cache holds values already rounded."""
        if not self.kv_bits:
            return mx.contiguous(keys), mx.contiguous(values)
        return (*kvquant.quantize(keys, self.kv_bits), *kvquant.quantize(values, self.kv_bits))

    def _kv_arrays(self, entry: tuple[mx.array, ...]) -> tuple[mx.array, mx.array]:
        """(keys, values) of a full-attention entry, dequantized when stored quantized."""
        if len(entry) == 2:
            return entry
        kq, ke, vq, ve = entry
        dtype = mx.float16 if self.kv_dtype == "float16" else mx.bfloat16 if self.kv_dtype == "bfloat16" else mx.float32
        return kvquant.dequantize(kq, ke, self.kv_bits, dtype), kvquant.dequantize(vq, ve, self.kv_bits, dtype)

    # --- using blocks ---------------------------------------------------------------------------

    def usable(self, payloads: Sequence[Payload], tail: Payload | None, tail_used: int, tail_len: int) -> bool:
        """Whether these blocks, then the first `tail_used` of the tail's `tail_len` positions,
        can be assembled into a cache equal to a cold run's: every window layer has its last
        min(P, W) positions, every recurrent layer a state at exactly P (the tail's end)."""
        if not payloads and not tail_used:
            return True
        for i, spec in enumerate(self.specs):
            if spec.kind == STATE:
                if tail is None or tail_used != tail_len or tail[i] is None:
                    return False
            elif spec.kind == WINDOW:
                pieces = window_pieces(payloads, tail, tail_used, tail_len, i, self.block_size)
                have = sum(k.shape[2] for k, _ in pieces)
                if have < min(len(payloads) * self.block_size + tail_used, spec.window):
                    return False
        return True

    def assemble(
        self,
        payloads: Sequence[Payload],
        tail: Payload | None = None,
        tail_tokens: int = 0,
        tail_len: int = 0,
        room: int = 0,
        direct: Sequence[Payload] = (),
    ) -> list[Any]:
        """A fresh prompt cache holding the given blocks in order, then the first `tail_tokens`
        of the tail's `tail_len` positions (nothing: an empty cache). Check `usable` first. With
        `room`, full-attention buffers have space for that many more tokens (rounded up to
        mlx-lm's 256-token step), so a lone prefill writes in place instead of copying to grow.
        `direct`: blocks after `payloads` read into buffers made for this request (a direct run,
        kv/runs.py; plain attention KV only, see `direct_positions`): those buffers become the
        cache, the other blocks and the tail copied into them."""
        prompt_cache = self.new_cache()
        length = (len(payloads) + len(direct)) * self.block_size + tail_tokens
        if not length:
            return prompt_cache
        runs.compact_pending(self.block_size)
        spans = runs.spans(payloads, self.block_size)  # a few per prefix: one join per layer of that many
        for i, (spec, cache) in enumerate(zip(self.specs, prompt_cache, strict=True)):
            if spec.kind == KV and direct:
                pieces = [self._kv_arrays(e) for e in runs.layer_pieces(spans, payloads, i)]
                run, lead = direct[0].run, direct[0].start
                tail_kv = tail[i] if tail_tokens else None
                fill_direct(cache, run.layers[i], pieces, lead, tail_kv, length, tail_tokens, room)
            elif spec.kind == KV:
                kv = [self._kv_arrays(e) for e in runs.layer_pieces(spans, payloads, i)]
                if tail_tokens:
                    kv.append(self._kv_arrays(tail[i]))
                fill_kv(cache, kv, tail_tokens, length, room)
            elif spec.kind == WINDOW:
                pieces = window_pieces(payloads, tail, tail_tokens, tail_len, i, self.block_size)
                keep = min(length, spec.window)
                keys, values = join_pair([k for k, _ in pieces], [v for _, v in pieces])
                cache.keys, cache.values = keys[..., -keep:, :], values[..., -keep:, :]
                cache.offset, cache._idx = length, keep
            elif spec.kind == STATE:
                for j, a in enumerate(tail[i]):
                    cache[j] = a
        mx.eval([a for c in prompt_cache for a in _cache_arrays(c)])
        return prompt_cache

    def direct_positions(self, prompt_len: int) -> int | None:
        """How many positions a request's cache for a `prompt_len`-token prompt holds when a
        lookup reads its prefix straight into it (what `assemble` makes with its room, the first
        generated token included); None when this layout cannot take such a read (anything but
        plain attention KV at the model's dtype)."""
        if self.kv_bits or not all(s.kind == KV for s in self.specs):
            return None
        return -(-(prompt_len + 1) // KVCache.step) * KVCache.step

    # --- the SSD's named arrays (kv/payloads.py) ------------------------------------------------

    def to_arrays(self, payload: Payload) -> dict[str, mx.array]:
        return payload_to_arrays(self.specs, payload)

    def from_arrays(self, arrays: dict[str, mx.array]) -> tuple[Payload, int]:
        return payload_from_arrays(self.specs, self.kv_bits, arrays)


def cache_layout(model: Any, block_size: int, kv_bits: int = 0) -> CacheLayout:
    """The model's cache layout for `block_size`-token blocks; `reason` is set when some layer's
    cache cannot be cached."""
    cache = make_prompt_cache(model)
    layers = getattr(model, "layers", None)
    specs, refused = [], set()
    for i, c in enumerate(cache):
        kind = type(c)
        if isinstance(layers, list) and i < len(layers) and layers[i] is None:  # pipeline: another rank's
            specs.append(LayerSpec(IDLE))
        elif kind is KVCache:
            specs.append(LayerSpec(KV))
        elif kind is RotatingKVCache and c.keep == 0:
            specs.append(LayerSpec(WINDOW, window=c.max_size))
        elif kind is ArraysCache:
            specs.append(LayerSpec(STATE, state_size=len(c.cache)))
        else:
            refused.add(kind.__name__ + (f"(keep={c.keep})" if kind is RotatingKVCache else ""))
    reason = f"model cache has {', '.join(sorted(refused))} layers, which are not cached" if refused else ""
    if kv_bits and not reason:
        dims = {c.keys.shape[-1] for c in _probe_cache(model, specs)}
        if not all(kvquant.supported(d) for d in dims):
            reason = f"kv_bits needs head dimensions divisible by {kvquant.GROUP}; this model has {sorted(dims)}"
    return CacheLayout(model, specs, reason, kv_dtype_of(model), block_size, kv_bits)


def _probe_cache(model: Any, specs: Sequence[LayerSpec]) -> list[Any]:
    """The full-attention caches after one token (their head dimensions)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    return [c for spec, c in zip(specs, cache, strict=True) if spec.kind == KV]


def unbatchable(model: Any) -> str:
    """Why mlx-lm's BatchGenerator cannot run this model ("" when it can): a layer cache with no
    `merge` (ChunkedKVCache, QuantizedKVCache in mlx-lm 0.32.2) cannot join a batch."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if not hasattr(c, "merge")})
    return f"its {', '.join(kinds)} layers cannot be batched by mlx-lm's BatchGenerator" if kinds else ""


def _window_range(c: Any) -> tuple[int, mx.array, mx.array]:
    """A rotating cache's positions in order: (first position, keys, values)."""
    if c.keys is None:
        return c.offset, mx.zeros((1, 1, 0, 1)), mx.zeros((1, 1, 0, 1))
    if c.keep:
        raise ValueError("rotating caches that keep leading positions are not cached")
    k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
    held = min(k.shape[2], c.offset)
    k, v = k[..., k.shape[2] - held :, :], v[..., v.shape[2] - held :, :]
    return c.offset - held, k, v


def borrowed_row(c: Any, idx: int, whole: bool = False) -> Any:
    """Row `idx` of a batch's layer cache as a cache of its own, to read or to take over: a
    full-attention layer's as a KVCache over views of the batch's arrays (no copy; with `whole`, a
    batch of one without padding hands over its arrays themselves, room kept, for a cache that goes
    on without the batch), other kinds mlx-lm's `extract` (a copy). A view held while the batch
    writes its arrays makes each write copy them whole: drop it before the batch's next step."""
    if not isinstance(c, BatchKVCache) or c.keys is None:
        return c.extract(idx)
    padding = int(c.left_padding[idx].item())
    row = KVCache()
    if whole and c.keys.shape[0] == 1 and padding == 0:
        row.keys, row.values = c.keys, c.values
    else:
        row.keys, row.values = (a[idx : idx + 1, :, padding : c._idx] for a in (c.keys, c.values))
    row.offset = c._idx - padding
    return row


def _rounded_caches(bits: int) -> tuple[type, type]:
    """(KVCache, BatchKVCache) subclasses that round keys and values to `bits` as they enter,
    so attention sees the same rounded KV in a cold run and on a hit. mlx-lm's batch builds its
    cache with the first cache's `merge`, and keeps that class through extend and filter."""

    class RoundedBatchKVCache(BatchKVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(kvquant.round_trip(keys, bits), kvquant.round_trip(values, bits))

        @classmethod
        def merge(cls, caches):
            if all(c.size() == 0 for c in caches):  # mlx-lm returns a plain BatchKVCache for these
                return cls([0] * len(caches))
            return super().merge(caches)

    class RoundedKVCache(KVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(kvquant.round_trip(keys, bits), kvquant.round_trip(values, bits))

        @classmethod
        def merge(cls, caches):
            return RoundedBatchKVCache.merge(caches)

    return RoundedKVCache, RoundedBatchKVCache


def _cache_arrays(c: Any) -> list[mx.array]:
    if isinstance(c, ArraysCache):
        return [a for a in c.cache if a is not None]
    return [a for a in (c.keys, c.values) if a is not None]


# --- M-RoPE (Qwen2-VL): tokens after an image sit at index + rope_delta (vision/qwen.py). mlx-lm's
# batch rotates new tokens by `offset` (nothing else reads it), built from each cache's length in the
# first cache's `merge`; a cache continuing at length + delta gets a `merge` adding every delta.


def shift_positions(prompt_cache: list[Any], delta: int) -> None:
    """Once this cache joins mlx-lm's batch, its next tokens are rotated at positions `delta` past
    its length. The batch merges its caches with the first one's `merge`, so every cache that joins
    a batch of this model needs the call (delta 0 for a text prompt). The cache's own offset, size
    and contents do not change (blocks cut from it are the same)."""
    for c in prompt_cache:
        c.rope_delta = delta
        c.merge = partial(_merge_shifted, c.merge)  # an instance attribute: this cache only


def _merge_shifted(merge: Any, caches: list[Any]) -> Any:
    batch = merge(caches)
    batch.offset = batch.offset + mx.array([getattr(c, "rope_delta", 0) for c in caches])
    return batch
