"""Runs: blocks registered together share one copy per layer, so a hit joins runs, not blocks.

Registering a request's new blocks copies each full-attention layer's positions once for all of
them (a run, as SGLang's radix nodes hold variable-length runs); each block's entry is a view of
that copy. Assembling a prefix then takes one slice of a run for each stretch of consecutive
blocks cut from it: a few array operations per layer however small the blocks are, where joining
one array per block per layer cost ~18 us each on the CPU (and a kernel launch each on a GPU).
Blocks keep their identity: hashes, token checks, pins, eviction and the SSD see one block each.

A run's memory lives while any of its blocks does. So that RAM's budget (which counts each block's
own bytes) stays near the truth, a run left with at most half its blocks in RAM is compacted: the
survivors are copied into runs of their own and the old one is freed once nothing reads it. RAM
reports blocks entering and leaving (`entered`, `left`, under its owner's lock, no MLX work); the
copies are made by `compact_pending` on the thread that owns MLX, before it assembles or slices.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import mlx.core as mx


class Run:
    """Per layer, the arrays of `num_blocks` consecutive blocks registered together (None for the
    layers kept per block; evaluated here), and those of its blocks that are in RAM (`members`, by id).
    `direct`: a request's own cache buffers, read from the SSD for it (kv/ssd/run_loads.py): its
    blocks' payloads hold no views yet (the request writes the buffers in place, past its prefix,
    and mlx would copy a buffer that a view shares) until `materialize` makes them."""

    __slots__ = ("layers", "num_blocks", "members", "owner", "direct", "__weakref__")

    def __init__(self, layers: list[Any], num_blocks: int, direct: bool = False):
        mx.eval([a for entry in layers if entry is not None for a in entry])
        self.layers = layers
        self.num_blocks = num_blocks
        self.members: dict[int, RunPayload] = {}
        self.owner = threading.get_ident()  # the thread that owns this model's MLX work (one per model)
        self.direct = direct


_lock = threading.Lock()  # guards every Run's members and _pending
# Runs to compact, by id; weakly: a run whose blocks are all gone (its model unloaded) needs nothing.
_pending: weakref.WeakValueDictionary[int, Run] = weakref.WeakValueDictionary()


class RunPayload(list):
    """A block's payload (kv/payloads.py) whose full-attention entries are views of `run`'s
    arrays, starting at position `start` of it."""

    __slots__ = ("run", "start")

    def __init__(self, entries: Sequence[Any], run: Run, start: int):
        super().__init__(entries)
        self.run = run
        self.start = start


def view(entry: tuple[mx.array, ...], lo: int, hi: int) -> tuple[mx.array, ...]:
    """Positions lo..hi-1 of a full-attention entry (keys, values; or their integers and
    exponents), as views: no copy."""
    return tuple(a[..., lo:hi, :] for a in entry)


def split(entry: tuple[mx.array, ...], count: int) -> list[tuple[mx.array, ...]]:
    """A full-attention entry's positions in `count` equal parts, as views, evaluated: one operation
    per array for all its parts (slicing each apart cost ~10 us a part: 100k parts at 16k tokens in
    16-token blocks). Every part is waited for: the SSD writer's thread reads them, and a part only
    evaluated as a sibling would wait there on this thread's stream."""
    parts = [mx.split(a, count, axis=2) for a in entry]
    mx.eval(parts)
    return list(zip(*parts, strict=True))


class Span(NamedTuple):
    """Consecutive blocks of a prefix that one array per layer can give: positions lo..hi-1 of
    `run`, or (run None) the block `payloads[index]` alone."""

    run: Run | None
    lo: int
    hi: int
    index: int


def spans(payloads: Sequence[Any], block_size: int) -> list[Span]:
    """The prefix's blocks grouped into spans, in order: a block continuing the previous block's
    run at the next position joins its span."""
    out: list[Span] = []
    for index, payload in enumerate(payloads):
        run = payload.run if isinstance(payload, RunPayload) else None
        if run is not None and out and out[-1].run is run and out[-1].hi == payload.start:
            out[-1] = out[-1]._replace(hi=payload.start + block_size)
        elif run is not None:
            out.append(Span(run, payload.start, payload.start + block_size, index))
        else:
            out.append(Span(None, 0, block_size, index))
    return out


def layer_pieces(spans_: Sequence[Span], payloads: Sequence[Any], layer: int) -> list[tuple[mx.array, ...]]:
    """One full-attention layer's entries for the prefix: one per span (a whole run as it is, a
    part of one as a view), in order."""
    out = []
    for span in spans_:
        if span.run is None:
            out.append(payloads[span.index][layer])
            continue
        entry = span.run.layers[layer]
        whole = span.lo == 0 and span.hi == entry[0].shape[2]
        out.append(entry if whole else view(entry, span.lo, span.hi))
    return out


def is_direct(payload: Any) -> bool:
    """Whether `payload` is a block of a direct read whose views are not made yet (Run.direct)."""
    return isinstance(payload, RunPayload) and payload.run.direct


def materialize(payloads: Sequence[RunPayload], block_size: int) -> None:
    """Make the full-attention entries of consecutive blocks of one direct run, in order: views of
    its buffers (one split per array), once the request that wrote them is done with them."""
    if not payloads:
        return
    run, lo = payloads[0].run, payloads[0].start
    count = len(payloads)
    parts = {
        i: split(view(entry, lo, lo + count * block_size), count)
        for i, entry in enumerate(run.layers)
        if entry is not None
    }
    for j, payload in enumerate(payloads):
        for i, entry_parts in parts.items():
            payload[i] = entry_parts[j]
    run.direct = False


def settle(run: Run) -> None:
    """A direct run whose blocks entered RAM: compacted (at the next `compact_pending`) when they
    fill at most half of its buffers (the blocks before them RAM held already, the room)."""
    with _lock:
        if run.members and 2 * len(run.members) <= run.num_blocks:
            _pending[id(run)] = run


def entered(payload: Any) -> None:
    """A block with this payload entered RAM."""
    if isinstance(payload, RunPayload):
        with _lock:
            payload.run.members[id(payload)] = payload


def left(payload: Any) -> None:
    """A block with this payload left RAM: its run is compacted once at most half of it is left."""
    if isinstance(payload, RunPayload):
        run = payload.run
        with _lock:
            run.members.pop(id(payload), None)
            if run.members and 2 * len(run.members) <= run.num_blocks:
                _pending[id(run)] = run


def compact_pending(block_size: int) -> None:
    """Copy the blocks still in RAM of each run marked by `left` into runs of their own (one per
    stretch of consecutive blocks), so the old run's memory can go. Only the calling thread's runs:
    each model's MLX work stays on the thread that owns it."""
    me = threading.get_ident()
    with _lock:
        runs = [run for run in list(_pending.values()) if run.owner == me]
        for run in runs:
            del _pending[id(run)]
    for run in runs:
        with _lock:
            members = sorted(run.members.values(), key=lambda p: p.start)
        stretches: list[list[RunPayload]] = []
        for payload in members:
            if stretches and stretches[-1][-1].start + block_size == payload.start:
                stretches[-1].append(payload)
            else:
                stretches.append([payload])
        for stretch in stretches:
            _recut(run, stretch, block_size)


def _recut(old: Run, stretch: list[RunPayload], block_size: int) -> None:
    """Make `stretch` (consecutive blocks of `old`, in order) views of a copy of their own. The new
    views are evaluated before they replace the old ones: another thread (the SSD writer) may read them."""
    lo, hi = stretch[0].start, stretch[-1].start + block_size
    layers = [None if e is None else tuple(mx.contiguous(a) for a in view(e, lo, hi)) for e in old.layers]
    cut = [
        {i: view(e, p.start - lo, p.start - lo + block_size) for i, e in enumerate(layers) if e is not None}
        for p in stretch
    ]
    run = Run(layers, len(stretch))
    mx.eval([a for c in cut for e in c.values() for a in e])
    with _lock:
        for payload, entries in zip(stretch, cut, strict=True):
            if old.members.pop(id(payload), None) is None:
                continue  # it left RAM meanwhile: it keeps reading the old run
            for i, entry in entries.items():
                payload[i] = entry
            payload.run, payload.start = run, payload.start - lo
            run.members[id(payload)] = payload
