"""Chained blake3 block hashes and the namespace they live in.

h_0 = namespace hash; h_i = blake3(h_{i-1} || u32 count || token ids of block i as u32 LE).
The namespace frames each of its parts with its length, so no two different namespaces (model
fingerprint, KV dtype, cache layout version, block size) can produce the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from blake3 import blake3

from ..checked_json import DamagedFile, Hex, MapOf, Str, load_json
from .fsmode import open_private, private_mkdir

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
HASH_BYTES = 32
IGNORED_FILES = {"mlx_kvserve_conversion.json"}
MAX_MEMO_BYTES = 16 * 1024 * 1024
# "path|dev|inode|size|mtime_ns|ctime_ns" -> blake3 hex digest of the file's bytes
MEMO_SCHEMA = MapOf(Str(4096), Hex(HASH_BYTES), max_items=50_000)


def framed(*parts: bytes) -> bytes:
    """Concatenate parts, each prefixed by its length (u64 LE), so boundaries are unambiguous."""
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def namespace_hash(
    model_fingerprint: str, kv_dtype: str, block_size: int, layout: int = LAYOUT_VERSION, cache_layout: str = ""
) -> bytes:
    """`cache_layout`: the model's per-layer cache kinds (blocks.CacheLayout.signature; "" for
    plain attention KV, whose namespaces predate it and stay as they were)."""
    parts = [
        b"mlx-kvserve",
        model_fingerprint.encode(),
        kv_dtype.encode(),
        str(layout).encode(),
        str(block_size).encode(),
    ]
    if cache_layout:
        parts.append(cache_layout.encode())
    return blake3(framed(*parts)).digest()


class BlockHasher:
    """Hashes the full blocks of a token sequence inside one namespace."""

    def __init__(self, namespace: bytes, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.namespace = namespace
        self.block_size = block_size

    def hash_blocks(self, tokens: Sequence[int], num_blocks: int | None = None) -> list[bytes]:
        """Chained hashes of the first `num_blocks` full blocks (default: all full blocks)."""
        bs = self.block_size
        n = len(tokens) // bs if num_blocks is None else min(num_blocks, len(tokens) // bs)
        data = np.asarray(tokens[: n * bs], dtype="<u4").tobytes()
        width = bs * 4
        count = struct.pack("<I", bs)
        hashes, parent = [], self.namespace
        for i in range(n):
            parent = blake3(parent + count + data[i * width : (i + 1) * width]).digest()
            hashes.append(parent)
        return hashes


def _file_digest(path: Path) -> str:
    hasher = blake3(max_threads=blake3.AUTO)
    hasher.update_mmap(str(path))
    return hasher.hexdigest()


def model_fingerprint(model_dir: Path, memo_file: Path | None = None, damaged: list[DamagedFile] | None = None) -> str:
    """A hash of the model's config and weight files' contents, stable across restarts.

    Hashing weights costs a fraction of a second per GB (scripts/bench_fingerprint.py), so per-file
    digests are memoized in `memo_file` keyed by the file's identity and change stamps: path,
    device, inode, size, mtime and ctime. Any write to a file moves its ctime, which no user call
    can set back (restoring the mtime with `touch -d` or `os.utime` moves it again), and a copy or
    a replacement is a new inode: weights edited in place are hashed again, so their blocks never
    meet the old model's. A restart with unchanged files reads only the memo. A damaged memo is
    set aside (appended to `damaged`) and rebuilt; failing to write it is only logged.
    """
    memo: dict[str, str] = {}
    if memo_file is not None:
        loaded = load_json(memo_file, MEMO_SCHEMA, MAX_MEMO_BYTES, "fingerprint memo")
        memo = loaded.value if loaded.value is not None else {}
        if loaded.damaged is not None and damaged is not None:
            damaged.append(loaded.damaged)
    # Only what defines the model: not our conversion marker, which names the source file's path and mtime.
    files = sorted(
        p
        for p in model_dir.iterdir()
        if p.suffix in (".json", ".safetensors") and p.is_file() and p.name not in IGNORED_FILES
    )
    parts, changed = [], False
    for path in files:
        key = _memo_key(path)
        if key not in memo:
            memo[key] = _file_digest(path)
            changed = True
        parts.append(framed(path.name.encode(), memo[key].encode()))
    if memo_file is not None and changed:
        _write_memo(memo_file, memo)
    return blake3(b"".join(parts)).hexdigest()


def _memo_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _write_memo(memo_file: Path, memo: dict[str, str]) -> None:
    """Best effort: without the memo the next start hashes the weights again."""
    tmp = memo_file.with_suffix(f".tmp{os.getpid()}")
    try:
        private_mkdir(memo_file.parent)
        with open_private(tmp, "w") as f:
            f.write(json.dumps(memo))
        os.replace(tmp, memo_file)
    except OSError as exc:
        log.warning("cannot write the fingerprint memo %s: %s", memo_file, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()
