"""The namespace block hashes live in, and the model fingerprint that names it.

The chain itself (h_i from h_{i-1} and block i's tokens) is mlx_kvserve/chain.py, which the router
shares. The namespace frames each of its parts with its length, so no two different namespaces (model
fingerprint, KV dtype, cache layout version, block size) can produce the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from blake3 import blake3

from ..chain import HASH_BYTES, framed
from ..checked_json import DamagedFile, Hex, MapOf, Str, load_json
from ..fsmode import open_private, private_mkdir

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # the block layout (array names: kv/ssd/format.py; shapes: kv/blocks.py), a namespace part
IGNORED_FILES = {"mlx_kvserve_conversion.json"}
MAX_MEMO_BYTES = 16 * 1024 * 1024
# "path|dev|inode|size|mtime_ns|ctime_ns" -> blake3 hex digest of the file's bytes
MEMO_SCHEMA = MapOf(Str(4096), Hex(HASH_BYTES), max_items=50_000)


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


def _file_digest(path: Path) -> str:
    hasher = blake3(max_threads=blake3.AUTO)
    hasher.update_mmap(str(path))
    return hasher.hexdigest()


def model_fingerprint(model_dir: Path, memo_file: Path | None = None, damaged: list[DamagedFile] | None = None) -> str:
    """A hash of the model's config and weight files' contents, stable across restarts.

    Hashing weights costs a fraction of a second per GB (docs/benchmarks-history-2026-12-07.md "Model fingerprint"), so per-file
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
