"""Chained blake3 block hashes: the one place a token sequence's block hashes are computed.

h_0 = the namespace (kv/hashing.py names it); h_i = blake3(h_{i-1} || u32 count || token ids of
block i as u32 LE). A leaf module: the engine's cache (kv/) and the router (which predicts which
backend holds a prompt) share it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
from blake3 import blake3

HASH_BYTES = 32


def framed(*parts: bytes) -> bytes:
    """Concatenate parts, each prefixed by its length (u64 LE), so boundaries are unambiguous."""
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


class BlockHasher:
    """Hashes the full blocks of a token sequence inside one namespace."""

    def __init__(self, namespace: bytes, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.namespace = namespace
        self.block_size = block_size

    def hash_blocks(
        self,
        tokens: Sequence[int],
        num_blocks: int | None = None,
        known: Sequence[bytes] = (),
        root: bytes | None = None,
    ) -> list[bytes]:
        """Chained hashes of the first `num_blocks` full blocks (default: all full blocks).
        `known`: the chain of a prefix of `tokens` computed before (a request's prompt, when its
        completion is registered): only the blocks after it are hashed. `root`: h_0's parent in
        place of the namespace (a principal's, kv/salts.py)."""
        bs = self.block_size
        n = len(tokens) // bs if num_blocks is None else min(num_blocks, len(tokens) // bs)
        start = min(len(known), n)
        data = np.asarray(tokens[start * bs : n * bs], dtype="<u4").tobytes()
        width = bs * 4
        count = struct.pack("<I", bs)
        hashes = list(known[:start])
        parent = hashes[-1] if hashes else (self.namespace if root is None else root)
        for i in range(n - start):
            parent = blake3(parent + count + data[i * width : (i + 1) * width]).digest()
            hashes.append(parent)
        return hashes


KEY_BASE = 1 << 30  # content keys live above every vocabulary (and below 2**31: u32 and i32 safe)


def content_keys(digest: bytes, count: int) -> list[int]:
    """`count` cache-key ids derived from a content digest (an image's): they stand in for the
    image's placeholder tokens in the ids the block chain hashes, so two images whose placeholders
    are the same token ids get different chains from the block holding their first token on."""
    stream = blake3(b"content-keys" + digest).digest(length=4 * count)
    words = np.frombuffer(stream, dtype="<u4") & np.uint32(KEY_BASE - 1)
    return [int(w) | KEY_BASE for w in words]
