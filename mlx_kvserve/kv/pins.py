"""External pin counts by block hash, kept apart from request references and persisted.

A pin count says "a user asked to keep this block"; a reference count (Block.ref_count) says
"a running request uses it". Pinning a block counts its whole ancestor chain too (the caller
passes the chain), so a pinned prefix is always usable from its first token. Thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from ..chain import HASH_BYTES
from ..checked_json import Const, DamagedFile, Hex, Int, MapOf, Obj, load_json, remove_leftover_temps
from ..errors import InsufficientStorageError
from ..fsmode import open_private
from .leases import PinLeases

log = logging.getLogger(__name__)

PINS_FILE = "pins.json"  # in the namespace's SSD folder
MAX_PINS_BYTES = 64 * 1024 * 1024  # ~900k pinned blocks
PINS_SCHEMA = Obj({"version": Const(1), "pins": MapOf(Hex(HASH_BYTES), Int(1, 2**31 - 1), max_items=1_000_000)})


class PinRegistry:
    def __init__(self, path: Path | None, leases: PinLeases | None = None):
        """`path`: where pins persist (JSON, written atomically on every change); None keeps
        them in memory only. A missing or damaged file starts empty (logged, see `_read`).
        `leases`: pins that expire (cache_control), counted as pins while they hold."""
        self.path = path
        self.leases = leases
        self._lock = threading.Lock()  # guards _counts
        self.damaged_files: list[DamagedFile] = []  # a pins file found damaged (and set aside) at startup
        self._counts: dict[bytes, int] = self._read()

    def _read(self) -> dict[bytes, int]:
        """The persisted counts, after removing temp files an interrupted write left. A damaged
        file is set aside and listed in damaged_files; the registry then starts without pins."""
        if self.path is None:
            return {}
        remove_leftover_temps(self.path)
        loaded = load_json(self.path, PINS_SCHEMA, MAX_PINS_BYTES, "pins file")
        if loaded.damaged is not None:
            self.damaged_files.append(loaded.damaged)
        pins = loaded.value["pins"] if loaded.value is not None else {}
        return {bytes.fromhex(h): n for h, n in pins.items()}

    def _save(self, counts: dict[bytes, int]) -> None:
        """Persist `counts`, then make them the registry's: a change that cannot be written is
        not applied (InsufficientStorageError naming the file and the OS error, 507 over HTTP).
        Caller holds _lock."""
        if self.path is not None:
            data = json.dumps({"version": 1, "pins": {h.hex(): n for h, n in counts.items()}})
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            try:
                with open_private(tmp, "w") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                log.error("pins file %s could not be written (%s); the pin change was not applied", self.path, exc)
                raise InsufficientStorageError(
                    f"the pin change was not applied: the pins file {self.path} could not be written "
                    f"({exc.strerror or exc})",
                    code="pins_not_saved",
                ) from None
        self._counts = counts  # one assignment: is_pinned (lock-free) sees the old or the new counts

    def pin(self, chain: Iterable[bytes]) -> None:
        """Add one pin to every hash of `chain` (a block and its ancestors; a hash listed twice
        gets two). All or nothing: raises InsufficientStorageError, changing nothing, when the
        pins file cannot be written."""
        with self._lock:
            counts = dict(self._counts)
            for block_hash in chain:
                counts[block_hash] = counts.get(block_hash, 0) + 1
            self._save(counts)

    def unpin(self, chain: Iterable[bytes]) -> None:
        """Remove one pin from every hash of `chain` that has one. All or nothing, as `pin`."""
        with self._lock:
            counts = dict(self._counts)
            for block_hash in chain:
                n = counts.get(block_hash, 0)
                if n <= 1:
                    counts.pop(block_hash, None)
                else:
                    counts[block_hash] = n - 1
            self._save(counts)

    def count(self, block_hash: bytes) -> int:
        with self._lock:
            return self._counts.get(block_hash, 0)

    def is_pinned(self, block_hash: bytes) -> bool:
        # A dict read is atomic under the GIL; called from other locks' critical sections (cheap).
        return self._counts.get(block_hash, 0) > 0 or (self.leases is not None and self.leases.covers(block_hash))

    def items(self) -> list[tuple[bytes, int]]:
        with self._lock:
            return list(self._counts.items())

    def __len__(self) -> int:
        """Pinned hashes: counted ones, plus those only a lease holds."""
        with self._lock:
            return len(self._counts) + (len(self.leases) if self.leases is not None else 0)
