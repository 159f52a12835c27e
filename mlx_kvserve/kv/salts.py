"""Per-principal cache namespaces ([cache] isolation = "per_key"): no principal gets a hit on
another's blocks, in RAM, on the SSD, in tails or after a restart.

- A principal's chain starts at its root instead of the model's namespace:
  root = blake3 keyed by the folder's secret (framed(namespace, identity)). The secret is 32 random
  bytes in a 0600 file beside the blocks it salts (made once, read at every start; RAM-only caches
  keep one in memory), so nobody without the file can compute a principal's hashes, and the salt
  never comes from a client. A chain's first block still records the namespace as its parent: that
  marks "no parent" for pins and prefetch whatever root its hash was computed from.
- Tails are keyed by their parent block's hash; a principal's are keyed by `tail_parent(parent,
  root)` instead, so a tail after a shared block (below) is still the principal's own.
- Shared pins: blocks pinned in the plain namespace (an admin pin marked shared, [cache]
  pin_on_start) are a prefix every principal may use. `principal_chain` takes the plain chain's
  leading pinned blocks, then the principal's own chain from there on: the blocks after a shared
  prefix are still keyed by the principal's root (their hash chains commit to the same tokens).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from blake3 import blake3

from ..chain import BlockHasher, framed
from ..fsmode import open_private

log = logging.getLogger(__name__)

SECRET_FILE = "principal_secret"
SECRET_BYTES = 32


def load_secret(folder: Path | None) -> bytes:
    """The folder's secret, made now when it has none (or a damaged one: the chains salted with the
    old one become unreachable, never another's). Without a folder, or when it cannot be written, a
    secret for this process only (logged): the SSD then holds nothing a later start could hit."""
    if folder is None:
        return os.urandom(SECRET_BYTES)
    path = Path(folder) / SECRET_FILE
    try:
        secret = path.read_bytes()
        if len(secret) == SECRET_BYTES:
            return secret
        log.warning("%s is damaged (%d bytes); a new secret replaces it", path, len(secret))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot read %s (%s): this process salts with a secret of its own", path, exc)
        return os.urandom(SECRET_BYTES)
    return _create_secret(path)


def _create_secret(path: Path) -> bytes:
    """Write a new secret: a temp file linked into place, so two processes starting on one folder
    agree on whichever came first."""
    tmp = path.with_name(f"{SECRET_FILE}.tmp{os.getpid()}")
    try:
        with open_private(tmp) as f:
            f.write(os.urandom(SECRET_BYTES))
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it meanwhile, or the old one was damaged
            data = path.read_bytes()
            if len(data) == SECRET_BYTES:
                return data
            os.replace(tmp, path)
        return path.read_bytes()
    except OSError as exc:
        log.warning("cannot write %s (%s): this process salts with a secret of its own", path, exc)
        return os.urandom(SECRET_BYTES)
    finally:
        tmp.unlink(missing_ok=True)


class CacheSalts:
    """Roots of principals' chains in one namespace. The secret is read (or made) at the first
    root asked for: a server nobody asks for one never writes the file. Thread-safe."""

    def __init__(self, folder: Path | None, namespace: bytes):
        self.folder = folder
        self.namespace = namespace
        self._lock = threading.Lock()  # guards _secret
        self._secret: bytes | None = None

    def root(self, identity: str) -> bytes:
        """The root of `identity`'s chain (api_keys.Principal.identity)."""
        with self._lock:
            if self._secret is None:
                self._secret = load_secret(self.folder)
            secret = self._secret
        return blake3(framed(self.namespace, identity.encode()), key=secret).digest()


def tail_parent(parent: bytes, root: bytes | None) -> bytes:
    """The key a tail after `parent` is stored under: `parent` itself without a principal (root
    None), else one only this principal's lookups compute."""
    return parent if root is None else blake3(b"tail" + root + parent).digest()


def principal_chain(
    hasher: BlockHasher, tokens: Sequence[int], root: bytes | None, is_shared: Callable[[bytes], bool]
) -> list[bytes]:
    """The chain a principal's lookup walks: the plain chain's leading blocks that `is_shared`
    (pinned in the plain namespace), then the principal's own chain (root `root`; None: the plain
    chain throughout)."""
    if root is None:
        return hasher.hash_blocks(tokens)
    own = hasher.hash_blocks(tokens, root=root)
    plain = hasher.hash_blocks(tokens)
    shared = 0
    while shared < len(plain) and is_shared(plain[shared]):
        shared += 1
    return plain[:shared] + own[shared:]
