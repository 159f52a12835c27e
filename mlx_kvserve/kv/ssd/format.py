"""The SSD tier's on-disk format, all of it: block and tail files, their names, their checksum.

A block lives in `<dir>/<hash[:2]>/<hash hex>.safetensors`: the payload arrays (named by
`kv_names`, `quantized_kv_names` and `state_name`) plus string metadata (magic, version, namespace,
block and parent hash, token ids, checksum). A file alone is enough to rebuild its index entry
(index.py), so losing the index costs only LRU/TTL history. The checksum covers the block's
identity (namespace, hashes, token ids) and every array's name, dtype, shape and bytes, so a
flipped byte anywhere in a file is caught. A tail is a block file too, named by `tail_key` and kept
under its parent's folder (tails.py). Writes go through a temp file that is fsync'd and renamed.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from blake3 import blake3
from xxhash import xxh3_128

from ...chain import HASH_BYTES, framed
from ...fsmode import create_private, open_private
from ...safe_files import open_regular, regular_path
from .writeback import start_writeback

FORMAT_MAGIC = "mlx-kvserve-block"
FORMAT_VERSION = 2  # 2: xxh3-128 checksum (1: blake3); files of another version are deleted at startup
BLOCK_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp.safetensors"  # mx.save_safetensors appends ".safetensors" to any other name
_MAX_HEADER_BYTES = 16 * 1024 * 1024


# --- the payload's array names (kv/blocks.py builds and reads payloads with them) ---------------
# They are the block layout: changing one means bumping hashing.LAYOUT_VERSION, a part of the
# namespace, so that blocks written under the old names are never read.


def kv_names(layer: int) -> tuple[str, str]:
    """The keys and values of an attention layer (full or sliding window)."""
    return f"{layer}.k", f"{layer}.v"


def quantized_kv_names(layer: int) -> tuple[str, str, str, str]:
    """Quantized keys and values (kv/kvquant.py): the integers and exponents of each."""
    return f"{layer}.kq", f"{layer}.ke", f"{layer}.vq", f"{layer}.ve"


def state_name(layer: int, index: int) -> str:
    """Array `index` of a recurrent layer's state."""
    return f"{layer}.s{index}"


# --- block files ---------------------------------------------------------------------------------


class FormatError(ValueError):
    """A block file that this store must not serve: unreadable, foreign or damaged."""


class BlockHeader(NamedTuple):
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    checksum: str


def block_relpath(block_hash: bytes) -> str:
    name = block_hash.hex()
    return f"{name[:2]}/{name}{BLOCK_SUFFIX}"


def hash_from_filename(shard: str, filename: str) -> bytes | None:
    """The block hash a canonical file name stands for, or None for any other name."""
    stem = filename.removesuffix(BLOCK_SUFFIX)
    if stem == filename or len(stem) != 2 * HASH_BYTES or stem[:2] != shard:
        return None
    try:
        block_hash = bytes.fromhex(stem)
    except ValueError:
        return None
    return block_hash if block_hash.hex() == stem else None  # fromhex accepts spaces and capitals


def encode_tokens(token_ids: Sequence[int]) -> str:
    return base64.b64encode(np.asarray(token_ids, dtype="<u4").tobytes()).decode()


def decode_tokens(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise FormatError("token ids are not whole u32 values")
    return tuple(np.frombuffer(raw, dtype="<u4").tolist())


def _array_bytes(arr: mx.array) -> memoryview | bytes:
    """The array's bytes in row-major order: the array's own memory when it is contiguous (a block's
    arrays are), a copy otherwise. A memoryview works for every dtype, bfloat16 included."""
    view = memoryview(arr)
    return view if view.c_contiguous else view.tobytes()


def block_checksum(namespace: bytes, header: BlockHeader, arrays: Mapping[str, mx.array]) -> str:
    """xxh3-128 over the block's identity, then every array's name, dtype and shape, then the arrays'
    bytes, in sorted-name order (header.checksum unused). It detects damage, it does not authenticate:
    the hashes and token ids decide identity, and a hit still compares token ids. xxh3 hashes ~13 GiB/s
    on one CPU core, blake3 ~2.5 GiB/s (scripts/bench_ssd_io.py, docs/benchmarks.md). The
    descriptors come first so that the bytes form one stream: a reader holding them in one buffer may
    hash them in one call, with the same result."""
    hasher = xxh3_128(
        framed(namespace, header.block_hash, header.parent_hash, encode_tokens(header.token_ids).encode())
    )
    names = sorted(arrays)
    for name in names:
        arr = arrays[name]
        hasher.update(framed(name.encode(), str(arr.dtype).encode(), repr(tuple(arr.shape)).encode()))
    for name in names:
        hasher.update(_array_bytes(arrays[name]))
    return hasher.hexdigest()


def block_metadata(namespace: bytes, header: BlockHeader) -> dict[str, str]:
    return {
        "format": FORMAT_MAGIC,
        "version": str(FORMAT_VERSION),
        "namespace": namespace.hex(),
        "block_hash": header.block_hash.hex(),
        "parent_hash": header.parent_hash.hex(),
        "token_ids": encode_tokens(header.token_ids),
        "num_tokens": str(len(header.token_ids)),
        "checksum": header.checksum,
    }


def parse_metadata(meta: Mapping[str, str], namespace: bytes) -> BlockHeader:
    """Check magic, version and namespace; raises FormatError naming what is wrong."""
    if meta.get("format") != FORMAT_MAGIC:
        raise FormatError("not a block file")
    if meta.get("version") != str(FORMAT_VERSION):
        raise FormatError(f"format version {repr(meta.get('version'))[:40]}, expected {FORMAT_VERSION}")
    if meta.get("namespace") != namespace.hex():
        raise FormatError("block of another namespace")
    try:
        token_ids = decode_tokens(meta["token_ids"])
        header = BlockHeader(
            bytes.fromhex(meta["block_hash"]), bytes.fromhex(meta["parent_hash"]), token_ids, meta["checksum"]
        )
        num_tokens = int(meta["num_tokens"])
    except (KeyError, ValueError, TypeError, OverflowError) as exc:  # any JSON may stand in a field
        raise FormatError(f"bad metadata: {type(exc).__name__}") from None
    if num_tokens != len(token_ids):
        raise FormatError("num_tokens does not match the token ids")
    return header


def read_header(path: Path, namespace: bytes) -> BlockHeader:
    """Parse a block file's safetensors header without reading its arrays: u64 LE length + JSON.
    Also checks that the arrays' extent matches the file size (catches truncation). Raises
    FormatError or OSError."""
    return parse_metadata(read_metadata(path), namespace)


def read_metadata(path: Path) -> dict[str, str]:
    """A block file's safetensors metadata, after checking the header against the file size.
    Raises FormatError or OSError (NotRegularFileError for a FIFO, device or link)."""
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise FormatError("truncated header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise FormatError("header length exceeds the file")
        try:
            tensors = json.loads(f.read(length))
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"header is not JSON: {type(exc).__name__}") from None
    if not isinstance(tensors, dict):
        raise FormatError("header is not a JSON object")
    meta = tensors.pop("__metadata__", None)
    if not isinstance(meta, dict):
        raise FormatError("no metadata")
    try:
        extent = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"bad tensor entry: {type(exc).__name__}") from None
    if 8 + length + extent != size:
        raise FormatError(f"file is {size} bytes, header describes {8 + length + extent}")
    return meta


def write_block_file(
    path: Path, namespace: bytes, header: BlockHeader, arrays: Mapping[str, mx.array], sync: bool = True
) -> int:
    """Write a block file (header.checksum is computed here) and fsync it; returns its size.
    `sync=False`: only start its writeback; the caller fsyncs it (with others) before using it.
    Raises on I/O failure, leaving no file behind."""
    try:
        header = header._replace(checksum=block_checksum(namespace, header, arrays))
        create_private(path)  # mlx creates files 0644 but keeps the mode of one it overwrites
        mx.save_safetensors(str(path), dict(arrays), metadata=block_metadata(namespace, header))
        if sync:
            fsync_path(path)
        else:
            start_writeback(path)
        return path.stat().st_size
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def read_block_file(path: Path, namespace: bytes, block_hash: bytes) -> tuple[BlockHeader, dict[str, mx.array]]:
    """Load and verify a block file. Raises FormatError (or mlx's RuntimeError) unless it is intact."""
    header, arrays = open_block_file(path, namespace, block_hash)
    mx.eval(arrays)  # one read of the file; array by array, the checksum would load each on its own (~8x slower)
    verify_block(namespace, header, arrays)
    return header, arrays


def open_block_file(path: Path, namespace: bytes, block_hash: bytes) -> tuple[BlockHeader, dict[str, mx.array]]:
    """A block file's header (read and checked now) and its arrays, not yet read: evaluating the
    arrays of several files together lets mlx read them in parallel. `verify_block` after the read.
    Only a regular file is opened (a FIFO would block mx.load, holding the GIL): anything else
    raises NotRegularFileError, an OSError, which callers treat as a damaged file."""
    with regular_path(path) as name:
        arrays, meta = mx.load(name, format="safetensors", return_metadata=True)
    header = parse_metadata(meta, namespace)
    if header.block_hash != block_hash:
        raise FormatError("file holds another block")
    return header, arrays


def verify_block(namespace: bytes, header: BlockHeader, arrays: Mapping[str, mx.array]) -> None:
    """Raise FormatError unless the (evaluated) arrays match the header's checksum."""
    if block_checksum(namespace, header, arrays) != header.checksum:
        raise FormatError("checksum mismatch")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never waits: a FIFO there fails fsync instead
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable; best effort (some filesystems refuse directory fsync)."""
    try:
        fsync_path(path)
    except OSError:
        pass


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder, fsync, rename. Raises OSError."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def block_files(cache_dir: Path) -> list[tuple[Path, bytes | None]]:
    """Every file in the shard folders with the hash its name stands for (None: not a block name)."""
    out = []
    for shard in os.scandir(cache_dir):
        if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
            continue
        for item in os.scandir(shard.path):
            if item.is_file(follow_symlinks=False):
                out.append((Path(item.path), hash_from_filename(shard.name, item.name)))
    return out


# --- tail files: block files named by their parent and tokens ------------------------------------


def tail_key(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    return blake3(b"tail" + parent_hash + np.asarray(token_ids, dtype="<u4").tobytes()).digest()


def check_identity(header: BlockHeader, path: Path, parent_hash: bytes) -> None:
    """Raise FormatError unless the tail file at `path` belongs under `parent_hash`: its header
    records that parent, and the header's key field and the file name are both the tail key of
    (parent, its token ids). The checksum (read_block_file) covers these fields and the namespace."""
    if header.parent_hash != parent_hash:
        raise FormatError("tail recorded under another parent")
    key = tail_key(parent_hash, header.token_ids)
    if header.block_hash != key or path.name != f"{key.hex()}{BLOCK_SUFFIX}":
        raise FormatError("tail not named for its parent and tokens")
