"""Reading a chain's block files straight into one buffer per full-attention array (a run), so that a
restore costs a few array operations per layer, however many blocks it reads.

Read one array per file (reads.py's per-block path), a restore of n blocks made n arrays per layer
side, each joined apart when the prefix was assembled (~500-1,500 joins per layer at 32k-128k
tokens, a kernel launch each on a GPU). Here the run's buffers are allocated once, for the whole
chain, and each file is read, verified and placed by one of the store's reading threads: its
header and table checked (against the model's layout, before any payload byte is read), its
payload read whole into the thread's own buffer and its keyed checksum taken there (exactly the
per-block read's check: identity, table, every byte), then each array copied to its place: a
full-attention array of a block, (1, heads, block_size, dim), lands at the block's positions of the
run's (1, heads, n * block_size, dim), one copy per array. No mlx call happens on those threads and
nothing of a file that fails reaches the run. The run's buffers are mlx's own memory written in
place, or, where arrays live apart from the CPU (CUDA), host buffers copied to the device once at
the end. A block's other arrays (a window layer's) go to a small buffer of its own.

Scattering the file straight into the run (one `preadv` of its pieces) and hashing the pieces in
place was tried first: the 256 small updates of the checksum a block made the reads 1.5-2x slower
than hashing one buffer (docs/architecture.md, "A restore").

What a run read gives the SSD tier is the run's arrays and each block's views of them: the tier
keeps them in RAM as a run (kv/runs.py), so the restore and every later hit join a few pieces per
layer.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ...safe_files import open_regular
from ..base import RequestBuffers
from ..concat import side_stream
from .format import _DTYPES, BlockHeader, FormatError, decode_table, parse_metadata, payload_checksum
from .format import _read_head as read_head  # the safetensors header, checked against the file size
from .table_check import TOKEN_AXIS, ArrayRule, TableExpectation, table_checker

_ALIGN = 16  # a block's other arrays start at multiples of this in its own buffer (as in a payload)


class RunLayout(NamedTuple):
    """The arrays a run holds (every full-attention array of the layout: required, per token), by
    name, with their rule, and the block size."""

    rules: Mapping[str, ArrayRule]
    block_size: int

    def block_bytes(self) -> int:
        """The most bytes one block adds to any of the run's arrays."""
        sizes = (
            math.prod(_with_positions(r.shape, self.block_size)) * _DTYPES[r.dtype].size for r in self.rules.values()
        )
        return max(sizes)


def run_layout(expect: TableExpectation | None) -> RunLayout | None:
    """The run arrays of a table expectation (kv/table_rules.py), or None when it has none (no
    layout known: the per-block read)."""
    if expect is None:
        return None
    rules = {n: r for n, r in sorted(expect.rules.items()) if r.required and r.per_token and len(r.shape) > TOKEN_AXIS}
    return RunLayout(rules, expect.block_size) if rules else None


class RunBuffers:
    """One byte buffer per run array for `num_blocks` blocks, writable from any thread through
    `host` (numpy views) once `allocate` (on mlx's thread) made them: the reading threads read and
    verify their first files meanwhile and wait (`ready`) only to place them. `in_place`: the
    buffers are mlx arrays written in place (CPU, Apple silicon); else host memory, copied to the
    device by `arrays`. `into`: a request's own buffers (kv/base.py RequestBuffers) of that many
    positions, the blocks placed after its lead; else the blocks' positions alone."""

    def __init__(self, layout: RunLayout, num_blocks: int, in_place: bool, into: RequestBuffers | None = None):
        self.layout = layout
        self.num_blocks = num_blocks
        self.in_place = in_place
        self.into = into
        bs = layout.block_size
        positions = into.positions if into is not None else num_blocks * bs
        self.shapes = {n: _with_positions(r.shape, positions) for n, r in layout.rules.items()}
        self.device: dict[str, mx.array] = {}
        self.host: dict[str, np.ndarray] = {}
        self._made = threading.Event()  # set by allocate, whether it worked or not (then host stays empty)

    def start(self) -> None:
        """Start making the buffers (mlx's thread) on the CPU's second stream, beside the reads mlx
        runs on its first: their fresh pages cost about what the disk takes to read them here."""
        if self.in_place and not self.device:
            sizes = {n: math.prod(s) * _DTYPES[self.layout.rules[n].dtype].size for n, s in self.shapes.items()}
            self.device = {n: mx.zeros((size,), mx.uint8, stream=side_stream()) for n, size in sizes.items()}
            mx.async_eval(list(self.device.values()))

    def allocate(self) -> None:
        """Make the buffers (mlx's thread; the reading threads wait for it). Raises what mlx or
        numpy raise (out of memory): the reading threads then fail their blocks."""
        try:
            sizes = {n: math.prod(s) * _DTYPES[self.layout.rules[n].dtype].size for n, s in self.shapes.items()}
            if self.in_place:
                self.start()
                mx.eval(list(self.device.values()))
                host = {n: np.asarray(memoryview(a)) for n, a in self.device.items()}
                if all(h.flags.writeable and h.flags.c_contiguous and h.size == sizes[n] for n, h in host.items()):
                    self.host = host
                else:  # mlx gave no plain writable memory: host buffers after all
                    self.device = {}
            if not self.device:  # a request's buffers zeroed, as its cache's room is (the run's are all written)
                make = np.zeros if self.into is not None else np.empty
                self.host = {n: make(size, np.uint8) for n, size in sizes.items()}
        finally:
            self._made.set()

    def ready(self) -> None:
        """Wait for `allocate`; raises MemoryError when it failed."""
        self._made.wait()
        if not self.host:
            raise MemoryError("the run's buffers could not be made")

    def place(self, name: str, shape: Sequence[int], block: int) -> np.ndarray:
        """Where a block's array `name` of `shape` goes in the run, as a writable (outer, bytes)
        view: a row per index before the token axis, each the block's positions in the run."""
        row = math.prod(shape[TOKEN_AXIS + 1 :]) * _DTYPES[self.layout.rules[name].dtype].size  # a position's bytes
        lead = self.into.lead_blocks if self.into is not None else 0
        start = (lead + block) * self.layout.block_size * row
        return self.host[name].reshape(math.prod(shape[:TOKEN_AXIS]), -1)[:, start : start + shape[TOKEN_AXIS] * row]

    def arrays(self, num_blocks: int) -> dict[str, mx.array]:
        """The run's arrays holding its first `num_blocks` blocks (evaluated; a copy of those when
        the chain stopped short, so no unused buffer is held; a request's buffers as they are). The
        buffers are let go: an array returned is then the only one holding its memory, so the
        request writes it in place (mlx copies an array that another one shares)."""
        out = {}
        for name, shape in self.shapes.items():
            raw = self.device[name] if self.device else mx.array(self.host[name])
            out[name] = raw.view(_DTYPES[self.layout.rules[name].dtype]).reshape(shape)
            if num_blocks < self.num_blocks and self.into is None:
                out[name] = mx.contiguous(out[name][:, :, : num_blocks * self.layout.block_size])
        mx.eval(list(out.values()))
        self.device, self.host = {}, {}
        return out


def _with_positions(shape: Sequence[int], positions: int) -> tuple[int, ...]:
    return tuple(positions if i == TOKEN_AXIS else x for i, x in enumerate(shape))


class BlockRead(NamedTuple):
    """A block file read into a run: its header, and its other arrays (name, dtype, shape, offset
    in `rest`). `other_tokens`: the file (verified) holds other token ids; nothing went to the run."""

    header: BlockHeader
    rest: np.ndarray | None
    rest_slots: tuple[tuple[str, str, tuple[int, ...], int], ...]
    other_tokens: bool = False


_staging = threading.local()  # each reading thread's payload buffer, reused (its pages stay mapped)


def _stage(size: int) -> np.ndarray:
    buf = getattr(_staging, "buf", None)
    if buf is None or buf.size < size:
        buf = _staging.buf = np.empty(size, np.uint8)
    return buf[:size]


def read_into_run(
    path: Path,
    namespace: bytes,
    block_hash: bytes,
    expected: Sequence[int],
    block: int,
    buffers: RunBuffers,
    *,
    key: bytes,
    expect: TableExpectation,
) -> BlockRead:
    """Read and verify the block file at `path`, then place it as block `block` of `buffers`.
    Raises FormatError or OSError (a damaged or unreadable file; nothing of it is placed). A
    verified file holding other token ids is reported, not placed. Thread-safe and mlx-free."""
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        meta, size = read_head(f)
        header = parse_metadata(meta, namespace)
        if header.block_hash != block_hash:
            raise FormatError("file holds another block")
        table_checker(expect)(header, size)  # before any payload byte is read
        payload = _stage(size)
        view, done = memoryview(payload), 0
        while done < size:
            got = f.readinto(view[done:])
            if not got:
                raise FormatError("file ended early")
            done += got
    return verify_into_run(namespace, header, view, expected, block, buffers, key=key)


def verify_into_run(
    namespace: bytes,
    header: BlockHeader,
    payload: memoryview,
    expected: Sequence[int],
    block: int,
    buffers: RunBuffers,
    *,
    key: bytes,
) -> BlockRead:
    """Verify a read payload (its header and table checked already) against its keyed checksum,
    then place it as block `block` of `buffers`. Raises FormatError when it fails (nothing placed);
    a verified payload of other token ids is reported, not placed. Thread-safe and mlx-free."""
    if payload_checksum(namespace, header, payload, key=key) != header.checksum:
        raise FormatError("checksum mismatch")
    if header.token_ids != tuple(expected):
        return BlockRead(header, None, (), other_tokens=True)
    buffers.ready()
    return _place(header, np.frombuffer(payload, np.uint8), buffers, block)


def _place(header: BlockHeader, payload: np.ndarray, buffers: RunBuffers, block: int) -> BlockRead:
    """Copy a verified payload's run arrays to their place in the run (a copy an array) and its
    other arrays to a buffer of the block's own."""
    slots = decode_table(header.table)
    others = [s for s in slots if s.name not in buffers.layout.rules]
    rest_slots, offset = [], 0
    for s in others:
        rest_slots.append((s.name, s.dtype, s.shape, offset))
        offset = -(-(offset + s.nbytes) // _ALIGN) * _ALIGN
    rest = np.empty(offset, np.uint8) if others else None
    for s, (_, _, _, at) in zip(others, rest_slots, strict=True):
        rest[at : at + s.nbytes] = payload[s.offset : s.offset + s.nbytes]
    for s in slots:
        if s.name in buffers.layout.rules and s.nbytes:
            place = buffers.place(s.name, s.shape, block)
            np.copyto(place, payload[s.offset : s.offset + s.nbytes].reshape(place.shape))
    return BlockRead(header, rest, tuple(rest_slots))


def rest_arrays(read: BlockRead) -> dict[str, mx.array]:
    """A block's other arrays (window layers' and such), as views of one mlx copy of its own
    buffer; run on mlx's thread. Raises FormatError for a shape mlx refuses."""
    if not read.rest_slots:
        return {}
    data = mx.array(read.rest)
    try:
        return {
            name: data[off : off + math.prod(shape) * _DTYPES[dtype].size].view(_DTYPES[dtype]).reshape(shape)
            for name, dtype, shape, off in read.rest_slots
        }
    except (ValueError, RuntimeError, OverflowError, TypeError) as exc:
        raise FormatError(f"array table mlx cannot use: {type(exc).__name__}") from None
