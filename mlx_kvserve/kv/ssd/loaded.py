"""What the store's reads hand back (reads.py, run_loads.py): verified blocks, alone or as views of a
run, and a read in progress; and whether this process reads block files through host memory."""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

from ..base import RequestBuffers


def reads_through_host() -> bool:
    """Whether this process reads block files through host memory: on a GPU that is not Apple's
    (CUDA), whose arrays live apart from the CPU. On a Mac and on the CPU, mlx reads them."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


class PendingLoad(NamedTuple):
    """Block files being read (SSDStore.begin_load): their expected token ids and, for each,
    (hash, index entry, header, payload not yet read) through mlx, or (hash, index entry, None,
    future of read_block_host or, with `run`, of read_into_run) through host memory."""

    expected: tuple[tuple[int, ...], ...]
    opened: list[tuple]
    run: Any = None  # run_reads.RunBuffers: the chain read into one buffer per full-attention array


class LoadedRun(NamedTuple):
    """The full-attention arrays of consecutive blocks read together (run_reads.py), by name:
    (1, heads, num_blocks * block_size, dim) each; with `into`, the request's buffers holding the
    blocks after its lead (and no view of them is made: the request writes them in place)."""

    arrays: dict[str, mx.array]
    num_blocks: int
    block_size: int
    into: RequestBuffers | None = None


class LoadedBlock(NamedTuple):
    """A verified block: its named arrays (with `run`, its full-attention arrays are views of the
    run's, at block `position` of it)."""

    token_ids: tuple[int, ...]
    arrays: dict[str, mx.array]
    parent_hash: bytes
    run: LoadedRun | None = None
    position: int = 0
