"""The SSD tier's on-disk format, all of it: block and tail files, their names, their checksum.

A block lives in `<dir>/<hash[:2]>/<hash hex>.safetensors`: a safetensors file holding one byte array,
the payload, with every array of the block (named by `kv_names`, `quantized_kv_names` and
`state_name`) laid end to end in it, plus string metadata (magic, version, namespace, block and
parent hash, token ids, the arrays' table, checksum). One array per file means one read and one
device copy per block, and a checksum over one buffer (format 2 held one safetensors array per
layer side: 64 reads and copies per Llama-3-8B block, 0.12x the raw read speed on a GPU). A file
alone is enough to rebuild its index entry (index.py), so losing the index costs only LRU/TTL
history. The checksum, keyed with the folder's secret (folder_key.py), covers the block's identity
(namespace, hashes, token ids), the table (every array's name, dtype, shape and offset) and the
payload's bytes: a flipped byte anywhere in a file is caught, and so is a file forged or edited
without the key. What the table may say is checked against the model (table_check.py). A tail is
a block file too, named by `tail_key` and kept under its parent's folder (tails.py). Writes go
through a temp file that is fsync'd and renamed.
"""

from __future__ import annotations

import base64
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from blake3 import blake3

from ...chain import HASH_BYTES, framed
from ...fsmode import open_private
from ...safe_files import open_regular, regular_path
from .writeback import start_writeback

FORMAT_MAGIC = "mlx-kvserve-block"
# 4: keyed blake3; 3: one payload array, xxh3-128; 2: an array per layer side; 1: blake3. Others are
# deleted at startup (a folder of an older version is recomputed).
FORMAT_VERSION = 4
BLOCK_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp.safetensors"  # mx.save_safetensors appends ".safetensors" to any other name
_MAX_HEADER_BYTES = 16 * 1024 * 1024
PAYLOAD = "payload"  # the one array of a block file
_ALIGN = 16  # every array starts at a multiple of this many bytes in the payload
_DTYPES = {
    str(d).removeprefix("mlx.core."): d
    for d in (
        mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
        mx.float16, mx.bfloat16, mx.float32, mx.float64,
    )
}  # fmt: skip


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


class ArraySlot(NamedTuple):
    """Where one array of a block lies in its payload."""

    name: str
    dtype: str  # a key of _DTYPES
    shape: tuple[int, ...]
    offset: int  # in bytes, a multiple of _ALIGN

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype].size


class BlockHeader(NamedTuple):
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    checksum: str
    table: str = ""  # the arrays' slots as JSON (encode_table), hashed as written


def encode_table(slots: Sequence[ArraySlot]) -> str:
    return json.dumps([[s.name, s.dtype, list(s.shape), s.offset] for s in slots], separators=(",", ":"))


def decode_table(text: str) -> tuple[ArraySlot, ...]:
    """The slots of a table; raises FormatError unless every entry is well formed, the names are
    unique, and the arrays lie in order, aligned, without overlapping."""
    try:
        rows = json.loads(text)
        slots = tuple(ArraySlot(str(n), str(d), tuple(int(x) for x in shape), int(o)) for n, d, shape, o in rows)
    except (ValueError, TypeError, RecursionError) as exc:  # any JSON may stand in the field
        raise FormatError(f"bad array table: {type(exc).__name__}") from None
    end = 0
    for slot in slots:
        if slot.dtype not in _DTYPES or any(x < 0 for x in slot.shape) or slot.offset < end or slot.offset % _ALIGN:
            raise FormatError(f"bad array slot {slot.name[:40]!r}")
        end = slot.offset + slot.nbytes
    if len({s.name for s in slots}) != len(slots):
        raise FormatError("array names repeat")
    return slots


def plan_payload(arrays: Mapping[str, mx.array]) -> tuple[tuple[ArraySlot, ...], int]:
    """Slots for `arrays` in sorted-name order, each aligned, and the payload's size in bytes."""
    slots, offset = [], 0
    for name in sorted(arrays):
        arr = arrays[name]
        offset = -(-offset // _ALIGN) * _ALIGN
        slots.append(ArraySlot(name, str(arr.dtype).removeprefix("mlx.core."), tuple(arr.shape), offset))
        offset += arr.nbytes
    return tuple(slots), offset


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
    arrays are), a copy otherwise, as bytes (blake3 takes byte buffers only; bfloat16 included)."""
    view = memoryview(arr)
    return view.cast("B") if view.c_contiguous else view.tobytes()


def block_checksum(namespace: bytes, header: BlockHeader, arrays: Mapping[str, mx.array], *, key: bytes) -> str:
    """blake3 keyed with the folder's `key` over the block's identity, then its array table (every
    array's name, dtype, shape and offset), then the payload's bytes (header.checksum and
    header.table unused: the table is the one `plan_payload` makes for `arrays`). Equal to
    `payload_checksum` of the file written from them. Keyed, it authenticates: a file made without
    the key fails it (format 3's xxh3 only detected damage; the cost: docs/benchmarks.md)."""
    slots, _ = plan_payload(arrays)
    return _checksum(key, namespace, header, encode_table(slots), _payload_chunks(slots, arrays))


def payload_checksum(
    namespace: bytes, header: BlockHeader, payload: mx.array | np.ndarray | memoryview, *, key: bytes
) -> str:
    """The checksum of a read block: identity, the table as the file holds it, the payload. Given a
    memoryview of the payload, it touches no mlx object (a thread other than mlx's may run it)."""
    data = memoryview(payload).cast("B")
    return _checksum(key, namespace, header, header.table, [data] if data.nbytes else [])


def _checksum(
    key: bytes, namespace: bytes, header: BlockHeader, table: str, chunks: Sequence[memoryview | bytes]
) -> str:
    hasher = blake3(
        framed(namespace, header.block_hash, header.parent_hash, encode_tokens(header.token_ids).encode()), key=key
    )
    hasher.update(framed(table.encode()))
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


def _payload_chunks(slots: Sequence[ArraySlot], arrays: Mapping[str, mx.array]) -> list[memoryview | bytes]:
    """The payload's bytes as a list of chunks: each array's bytes, zeros where alignment pads."""
    chunks: list[memoryview | bytes] = []
    position = 0
    for slot in slots:
        if slot.offset > position:
            chunks.append(bytes(slot.offset - position))
        if slot.nbytes:
            chunks.append(_array_bytes(arrays[slot.name]))
        position = slot.offset + slot.nbytes
    return chunks


def block_metadata(namespace: bytes, header: BlockHeader) -> dict[str, str]:
    return {
        "format": FORMAT_MAGIC,
        "version": str(FORMAT_VERSION),
        "namespace": namespace.hex(),
        "block_hash": header.block_hash.hex(),
        "parent_hash": header.parent_hash.hex(),
        "token_ids": encode_tokens(header.token_ids),
        "num_tokens": str(len(header.token_ids)),
        "arrays": header.table,
        "checksum": header.checksum,
    }


def parse_metadata(meta: Mapping[str, str], namespace: bytes) -> BlockHeader:
    """Check magic, version and namespace; raises FormatError naming what is wrong. The array
    table is kept as written (decode_table checks it when the arrays are read)."""
    if meta.get("format") != FORMAT_MAGIC:
        raise FormatError("not a block file")
    if meta.get("version") != str(FORMAT_VERSION):
        raise FormatError(f"format version {repr(meta.get('version'))[:40]}, expected {FORMAT_VERSION}")
    if meta.get("namespace") != namespace.hex():
        raise FormatError("block of another namespace")
    try:
        token_ids = decode_tokens(meta["token_ids"])
        header = BlockHeader(
            bytes.fromhex(meta["block_hash"]),
            bytes.fromhex(meta["parent_hash"]),
            token_ids,
            meta["checksum"],
            meta["arrays"],
        )
        num_tokens = int(meta["num_tokens"])
    except (KeyError, ValueError, TypeError, OverflowError) as exc:  # any JSON may stand in a field
        raise FormatError(f"bad metadata: {type(exc).__name__}") from None
    if num_tokens != len(token_ids) or not isinstance(header.table, str):
        raise FormatError("num_tokens does not match the token ids" if isinstance(header.table, str) else "bad table")
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
        return _read_head(f)[0]


def _read_head(f) -> tuple[dict[str, str], int]:
    """(metadata, the data's size) of the safetensors file `f`, positioned at its start; leaves it
    at the data. Checks the header against the file size."""
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
    if set(tensors) - {PAYLOAD}:
        raise FormatError("arrays other than the payload")
    return meta, extent


def write_block_file(
    path: Path, namespace: bytes, header: BlockHeader, arrays: Mapping[str, mx.array], sync: bool = True, *, key: bytes
) -> int:
    """Write a block file (header.checksum and header.table are made here) and fsync it; returns its
    size. The arrays' bytes go to the file straight from their memory, without a joined copy.
    `sync=False`: only start its writeback; the caller fsyncs it (with others) before using it.
    Raises on I/O failure, leaving no file behind."""
    try:
        slots, size = plan_payload(arrays)
        chunks = _payload_chunks(slots, arrays)
        table = encode_table(slots)
        header = header._replace(table=table, checksum=_checksum(key, namespace, header, table, chunks))
        head = json.dumps(
            {PAYLOAD: {"dtype": "U8", "shape": [size], "data_offsets": [0, size]},
             "__metadata__": block_metadata(namespace, header)},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes with spaces
        with open_private(path) as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for chunk in chunks:
                f.write(chunk)
        if sync:
            fsync_path(path)
        else:
            start_writeback(path)
        return path.stat().st_size
    except BaseException:
        path.unlink(missing_ok=True)
        raise


TableCheck = Callable[[BlockHeader, int], None]  # (header, payload bytes): raises FormatError (table_check.py)


def read_block_file(
    path: Path, namespace: bytes, block_hash: bytes, *, key: bytes, check: TableCheck | None = None
) -> tuple[BlockHeader, dict[str, mx.array]]:
    """Load and verify a block file: its header and named arrays, the table passing `check` before
    the payload is read. Raises FormatError (or mlx's RuntimeError) unless it is intact."""
    header, payload = open_block_file(path, namespace, block_hash)
    if check is not None:
        check(header, payload.size)
    mx.eval(payload)
    return header, verified_arrays(namespace, header, payload, key=key)


def open_block_file(path: Path, namespace: bytes, block_hash: bytes) -> tuple[BlockHeader, mx.array]:
    """A block file's header (read and checked now) and its payload, not yet read: evaluating the
    payloads of several files together lets mlx read them in parallel. `verified_arrays` after the
    read. Only a regular file is opened (a FIFO would block mx.load, holding the GIL): anything else
    raises NotRegularFileError, an OSError, which callers treat as a damaged file."""
    with regular_path(path) as name:
        arrays, meta = mx.load(name, format="safetensors", return_metadata=True)
    header = parse_metadata(meta, namespace)
    if header.block_hash != block_hash:
        raise FormatError("file holds another block")
    payload = arrays.get(PAYLOAD)
    if len(arrays) != 1 or payload is None or payload.dtype != mx.uint8 or payload.ndim != 1:
        raise FormatError("no payload array")
    return header, payload


def verified_arrays(namespace: bytes, header: BlockHeader, payload: mx.array, *, key: bytes) -> dict[str, mx.array]:
    """The named arrays of an evaluated payload, after checking it against the header's checksum
    and table; raises FormatError. The arrays are views of the payload: no copy."""
    if payload_checksum(namespace, header, payload, key=key) != header.checksum:
        raise FormatError("checksum mismatch")
    return payload_arrays(header, payload)


def payload_arrays(header: BlockHeader, payload: mx.array) -> dict[str, mx.array]:
    """The named arrays of a payload (checksummed already), as views of it; raises FormatError
    when the table does not fit the payload."""
    slots = decode_table(header.table)
    if (slots[-1].offset + slots[-1].nbytes if slots else 0) != payload.size:
        raise FormatError("array table does not match the payload's size")
    try:  # a shape mlx refuses (a dimension past its int range) is a bad table, not a crash
        return {s.name: payload[s.offset : s.offset + s.nbytes].view(_DTYPES[s.dtype]).reshape(s.shape) for s in slots}
    except (ValueError, RuntimeError, OverflowError, TypeError) as exc:
        raise FormatError(f"array table mlx cannot use: {type(exc).__name__}") from None


def read_block_host(
    path: Path, namespace: bytes, block_hash: bytes, *, key: bytes, check: TableCheck | None = None
) -> tuple[BlockHeader, np.ndarray]:
    """A block file's header and payload read into host memory and checked against its checksum
    there (not through mlx): for a device whose arrays live apart from the CPU (CUDA), where
    hashing an mlx array reads it back from the device. Thread-safe and mlx-free, so several files
    are read at once on a thread pool; `mx.array(payload)` then makes the one device copy. The
    table passes `check` before the buffer is allocated. Raises FormatError or OSError."""
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        meta, size = _read_head(f)
        header = parse_metadata(meta, namespace)
        if header.block_hash != block_hash:
            raise FormatError("file holds another block")
        if check is not None:
            check(header, size)
        payload = np.empty(size, dtype=np.uint8)
        view, done = memoryview(payload), 0
        while done < size:
            got = f.readinto(view[done:])
            if not got:
                raise FormatError("file ended early")
            done += got
    if payload_checksum(namespace, header, payload, key=key) != header.checksum:
        raise FormatError("checksum mismatch")
    return header, payload


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
