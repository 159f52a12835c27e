"""On-disk layout of the SSD tier: the block file format and the persisted index.

A block lives in `<dir>/<hash[:2]>/<hash hex>.safetensors`: the payload arrays plus string
metadata (magic, version, namespace, block and parent hash, token ids, checksum). A file alone is
enough to rebuild its index entry, so the index is a cache of file headers plus access times:
losing it costs only LRU/TTL history, because `SSDStore.validate_index` adopts the files again.
The checksum covers the block's identity (namespace, hashes, token ids) and every array's name,
dtype, shape and bytes, so a flipped byte anywhere in a file is caught.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from blake3 import blake3
from xxhash import xxh3_128

from ..checked_json import Const, Float, Hex, Int, MapOf, Obj, parse_json, read_json
from .fsmode import create_private, open_private
from .hashing import HASH_BYTES, framed
from .safe_files import open_regular, regular_path
from .writeback import start_writeback

log = logging.getLogger(__name__)

FORMAT_MAGIC = "mlx-kvserve-block"
FORMAT_VERSION = 2  # 2: xxh3-128 checksum (1: blake3); files of another version are deleted at startup
INDEX_VERSION = 1
INDEX_NAME = "index.json"
BLOCK_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp.safetensors"  # mx.save_safetensors appends ".safetensors" to any other name
_MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_INDEX_BYTES = 512 * 1024 * 1024  # ~3 million entries; a larger file is treated as damaged
INDEX_ENTRY_SCHEMA = Obj(
    {
        "num_tokens": Int(0, 2**31 - 1),
        "tokens_digest": Hex(16),
        "last_accessed": Float(0.0),
        "size": Int(0, 2**62),
    }
)
INDEX_SCHEMA = Obj(
    {
        "version": Const(INDEX_VERSION),
        "namespace": Hex(HASH_BYTES),
        "entries": MapOf(Hex(HASH_BYTES), INDEX_ENTRY_SCHEMA, max_items=10_000_000),
    }
)


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


def tokens_digest(token_ids: Sequence[int]) -> str:
    """A short digest of the token ids, kept in the index to tell a dedup from a collision."""
    return blake3(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()[:32]


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


def folder_namespace(folder: Path) -> bytes | None:
    """The namespace a store folder holds: from its index, else (a crash before the first index
    write, or a damaged index) from the first block file whose header names a namespace that
    matches the folder's name. None when neither says."""
    try:
        doc = read_json(folder / INDEX_NAME, Obj({"namespace": Hex(HASH_BYTES)}), MAX_INDEX_BYTES)
        namespace = bytes.fromhex(doc["namespace"])
        if namespace.hex().startswith(folder.name):
            return namespace
    except (OSError, ValueError):  # the store sets a damaged index aside when it opens the folder
        pass
    for path, block_hash in block_files(folder):
        if block_hash is None:
            continue
        try:
            namespace = bytes.fromhex(read_metadata(path).get("namespace", ""))
        except (OSError, ValueError):
            continue
        if len(namespace) == HASH_BYTES and namespace.hex().startswith(folder.name):
            return namespace
    return None


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


@dataclass
class IndexEntry:
    """What the store knows about one block file without opening it. The path derives from the hash."""

    num_tokens: int
    tokens_digest: str
    last_accessed: float  # wall-clock seconds (the store's clock)
    size: int  # file bytes


class BlockIndex:
    """hash -> IndexEntry in LRU order (least recently used first) with the byte total.
    Not thread-safe: SSDStore's lock guards it."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def items(self) -> Iterator[tuple[bytes, IndexEntry]]:
        """A snapshot in LRU order, safe to iterate while removing."""
        return iter(list(self._entries.items()))

    def get(self, block_hash: bytes) -> IndexEntry | None:
        return self._entries.get(block_hash)

    def add(self, block_hash: bytes, entry: IndexEntry) -> None:
        self.remove(block_hash)
        self._entries[block_hash] = entry
        self.used_bytes += entry.size

    def remove(self, block_hash: bytes) -> IndexEntry | None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.used_bytes -= entry.size
        return entry

    def touch(self, block_hash: bytes, now: float) -> None:
        self._entries[block_hash].last_accessed = now
        self._entries.move_to_end(block_hash)

    def resize(self, block_hash: bytes, size: int) -> None:
        entry = self._entries[block_hash]
        self.used_bytes += size - entry.size
        entry.size = size

    def sort_by_access(self) -> None:
        """Restore LRU order from last_accessed (after loading or adopting entries)."""
        ordered = sorted(self._entries.items(), key=lambda kv: kv[1].last_accessed)
        self._entries = OrderedDict(ordered)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """A copy of the entries for to_json, cheap enough to take under the store's lock."""
        return {h.hex(): dict(vars(e)) for h, e in self._entries.items()}

    @staticmethod
    def to_json(snapshot: dict[str, dict[str, Any]], namespace: bytes) -> bytes:
        return json.dumps({"version": INDEX_VERSION, "namespace": namespace.hex(), "entries": snapshot}).encode()

    @classmethod
    def from_json(cls, data: bytes, namespace: bytes, now: float | None = None) -> BlockIndex:
        """Raises ValueError (checked_json.DamagedFileError) for a damaged index or one written for
        another namespace or version."""
        return cls.from_doc(parse_json(data, INDEX_SCHEMA), namespace, now)

    @classmethod
    def from_doc(cls, doc: dict[str, Any], namespace: bytes, now: float | None = None) -> BlockIndex:
        """The index from a document that passed INDEX_SCHEMA. An access time after `now` (when
        given) reads as `now`: a block "used in the future" would outlive the TTL and the LRU.
        Raises ValueError when it was written for another namespace."""
        if doc["namespace"] != namespace.hex():
            raise ValueError("index of another namespace")
        index = cls()
        for name, fields in doc["entries"].items():
            entry = IndexEntry(**fields)
            if now is not None:
                entry.last_accessed = min(entry.last_accessed, now)
            index.add(bytes.fromhex(name), entry)
        index.sort_by_access()
        return index


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


def reconcile(
    index: BlockIndex,
    cache_dir: Path,
    namespace: bytes,
    check_headers: bool,
    delete: bool = True,
    others_write: bool = False,
) -> dict[str, int]:
    """Make `index` match the block files: drop entries without a file, adopt valid unindexed
    files, delete invalid and temp files (unless not `delete`: a guest server only leaves them
    out). `others_write`: other servers share the folder, so a temp file whose writer is alive is
    a write in progress, kept. Returns counts: kept, dropped_missing, adopted, deleted_invalid,
    deleted_temp. Headers of indexed files are read only if `check_headers`."""
    counts = dict.fromkeys(("kept", "dropped_missing", "adopted", "deleted_invalid", "deleted_temp"), 0)
    unlink = _unlink if delete else (lambda _path: 0)
    for path in cache_dir.glob(f"{INDEX_NAME}.*.tmp"):
        counts["deleted_temp"] += unlink(path)
    seen: set[bytes] = set()
    for path, block_hash in block_files(cache_dir):
        if block_hash is None:
            if others_write and path.name.endswith(TEMP_SUFFIX) and _writer_alive(path.name):
                continue  # a server sharing the folder is writing it
            counts["deleted_temp" if path.name.endswith(TEMP_SUFFIX) else "deleted_invalid"] += unlink(path)
            continue
        outcome = _reconcile_file(index, path, block_hash, namespace, check_headers, unlink)
        counts[outcome] += 1
        if outcome != "deleted_invalid":
            seen.add(block_hash)
    for block_hash, _ in index.items():
        if block_hash not in seen:
            index.remove(block_hash)
            counts["dropped_missing"] += 1
    index.sort_by_access()
    return counts


def _reconcile_file(
    index: BlockIndex, path: Path, block_hash: bytes, namespace: bytes, check_headers: bool, unlink: Callable
) -> str:
    entry = index.get(block_hash)
    try:
        stat = path.stat()
        if check_headers or entry is None:
            header = read_header(path, namespace)
            if header.block_hash != block_hash:
                raise FormatError("file holds another block")
    except (OSError, FormatError) as exc:
        log.debug("SSD file %s invalid (%s); deleted", path.name, exc)  # the report counts them
        index.remove(block_hash)
        unlink(path)
        return "deleted_invalid"
    if entry is None:
        ids = header.token_ids
        index.add(block_hash, IndexEntry(len(ids), tokens_digest(ids), stat.st_mtime, stat.st_size))
        return "adopted"
    if check_headers:  # the file is the truth about its tokens
        entry.num_tokens, entry.tokens_digest = len(header.token_ids), tokens_digest(header.token_ids)
    if entry.size != stat.st_size:
        index.resize(block_hash, stat.st_size)
    return "kept"


def _writer_alive(temp_name: str) -> bool:
    """Whether the temp file's writer (`<hash>.<pid>-<n>.tmp…`) is another live process."""
    match = re.fullmatch(r"[0-9a-f]+\.(\d+)-\d+" + re.escape(TEMP_SUFFIX), temp_name)
    if match is None:
        return False
    pid = int(match.group(1))
    if pid == os.getpid() or not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except OSError:
        return 0
