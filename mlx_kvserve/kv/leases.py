"""Pins that expire: Anthropic's `cache_control`, as leases on block chains.

A lease keeps one chain (its blocks' hashes, root first) pinned until its expiry; each use of the
chain pushes the expiry out by the lease's TTL again. Leases are a second layer over the pin counts
of PinRegistry: a block is pinned while a count or an unexpired lease covers it, so an expired lease
needs no timer to end, it simply stops covering. Leases hold at most `max_bytes` of blocks (a share
of the cache budgets): granting past it releases the leases that would expire first. They persist
(wall-clock expiries) in `leases.json` beside pins.json, so a 1-hour pin survives a restart.

No API removes a lease, so what the file says is bounded when it is read: a TTL to MAX_TTL_S, an
expiry to now + its TTL (no lease can outlive its TTL from its last use), and the leases are
refitted to the cap (in blocks of the size the file records) and to MAX_LEASES. A damaged file is
set aside and listed in `damaged_files`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..chain import HASH_BYTES
from ..checked_json import Const, DamagedFile, Float, Hex, Int, MapOf, Obj, Str, load_json, remove_leftover_temps
from ..fsmode import open_private

log = logging.getLogger(__name__)

LEASES_FILE = "leases.json"
MAX_LEASES = 4096
SAVE_EVERY_S = 30.0  # a refresh (or a renewed grant) is written at most this often (a new grant at once)
MAX_CHAIN = 1 << 20  # blocks in one leased chain
MAX_TTL_S = 3600.0  # the longest cache_control TTL ("1h"); longer ones are cut to it
LEASE_SCHEMA = Obj(  # {tip hash: {the chain's hashes concatenated, TTL, expiry}}, and one block's size
    {
        "version": Const(1),
        "leases": MapOf(
            Hex(HASH_BYTES),
            Obj({"chain": Str(2 * HASH_BYTES * MAX_CHAIN), "ttl_s": Float(1, 86400 * 7), "expires": Float()}),
            max_items=MAX_LEASES,
        ),
    },
    optional={"block_bytes": Int(0, 2**40)},  # absent from files of earlier versions
)


@dataclass
class Lease:
    chain: tuple[bytes, ...]  # root first; the last hash names the lease
    ttl_s: float
    expires: float  # wall-clock seconds


class PinLeases:
    def __init__(self, path: Path | None, max_bytes: int = 0, clock: Callable[[], float] = time.time):
        """`max_bytes` <= 0: no cap. `clock`: wall-clock seconds (tests pass a fake one)."""
        self.path = path
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()  # guards _leases, _block_bytes and the file
        self.damaged_files: list[DamagedFile] = []  # a leases file found damaged (and set aside) at startup
        self._block_bytes = 0  # one block's size, as the last grant knew it (0: unknown)
        self.released_for_room = 0  # leases given up to stay under max_bytes
        self._leases: dict[bytes, Lease] = self._read()
        self._fit(self._limit_blocks(), keep=b"")  # the cap may be smaller now than when they were written
        self._cover: dict[bytes, float] = {}  # hash -> latest expiry of the leases holding it
        self._saved_at = 0.0
        self._recount()

    # --- reading -----------------------------------------------------------------------------------

    def covers(self, block_hash: bytes) -> bool:
        """Whether an unexpired lease holds this block. Lock-free (a dict read)."""
        return self._cover.get(block_hash, 0.0) > self.clock()

    @property
    def active(self) -> bool:
        """Whether any lease is held (expired ones included until the next grant drops them)."""
        return bool(self._leases)

    def __len__(self) -> int:
        now = self.clock()
        return sum(1 for e in list(self._cover.values()) if e > now)

    def items(self) -> list[dict]:
        """The unexpired leases, for /v1/cache/pins."""
        now = self.clock()
        with self._lock:
            return [
                {
                    "block_hash": tip.hex(),
                    "blocks": len(lease.chain),
                    "ttl_s": lease.ttl_s,
                    "expires_in_s": round(lease.expires - now, 1),
                }
                for tip, lease in sorted(self._leases.items(), key=lambda kv: kv[1].expires)
                if lease.expires > now
            ]

    # --- changing ----------------------------------------------------------------------------------

    def grant(self, chain: Sequence[bytes], ttl_s: float, block_bytes: int = 0) -> int:
        """Lease `chain` (root first) for `ttl_s` from now, or push out the lease it already has.
        `block_bytes`: one block's size, for the cap (0: unknown, capped by the size last known, if
        any). `ttl_s` is cut to MAX_TTL_S. Returns how many blocks are leased (fewer than the chain when the cap cuts it;
        0 for an empty chain)."""
        if not chain:
            return 0
        now = self.clock()
        ttl_s = min(ttl_s, MAX_TTL_S)
        with self._lock:
            before = len(self._leases)
            self._drop_expired(now)
            self._block_bytes = block_bytes or self._block_bytes
            limit = self._limit_blocks()
            chain = tuple(chain[:limit])  # None: the whole chain
            if not chain:
                return 0
            old = self._leases.get(chain[-1])
            lease = self._leases[chain[-1]] = Lease(chain, ttl_s, max(now + ttl_s, old.expires if old else 0.0))
            self._fit(limit, keep=chain[-1])
            if len(self._leases) < before + (old is None):  # some lease ended: what it covered may not be
                self._recount()
            else:  # only this chain's cover grows: an agent's session renews and extends a few chains a turn
                self._cover_chain(lease)
            renewal = old is not None and old.chain == chain and old.ttl_s == ttl_s
            if not renewal or now - self._saved_at >= SAVE_EVERY_S:  # a renewal is written as a refresh
                self._save(now)
            return len(chain)

    def touch(self, hashes: Iterable[bytes]) -> int:
        """A request used these blocks: every lease whose chain ends among them lives its TTL
        again from now. Returns how many leases were refreshed."""
        if not self._leases:
            return 0
        now = self.clock()
        with self._lock:
            refreshed = 0
            for block_hash in hashes:
                lease = self._leases.get(block_hash)
                if lease is not None and lease.expires > now:
                    lease.expires = max(lease.expires, now + lease.ttl_s)
                    refreshed += 1
            if refreshed:
                self._recount()
                if now - self._saved_at >= SAVE_EVERY_S:
                    self._save(now)
            return refreshed

    def _limit_blocks(self) -> int | None:
        """The cap in blocks of the size last known; None when uncapped or the size is unknown."""
        if self.max_bytes <= 0 or self._block_bytes <= 0:
            return None
        return self.max_bytes // self._block_bytes

    def _fit(self, limit_blocks: int | None, keep: bytes) -> None:
        """Release the leases that expire first until there are at most MAX_LEASES (so the file
        reads back) and the leased blocks fit `limit_blocks` (None: no cap)."""
        while len(self._leases) > MAX_LEASES or (
            limit_blocks is not None and len({h for lease in self._leases.values() for h in lease.chain}) > limit_blocks
        ):
            victims = sorted((lease.expires, tip) for tip, lease in self._leases.items() if tip != keep)
            if not victims:
                return
            del self._leases[victims[0][1]]
            self.released_for_room += 1

    def _drop_expired(self, now: float) -> None:
        for tip in [t for t, lease in self._leases.items() if lease.expires <= now]:
            del self._leases[tip]

    def _cover_chain(self, lease: Lease) -> None:
        cover = dict(self._cover)
        for h in lease.chain:
            cover[h] = max(cover.get(h, 0.0), lease.expires)
        self._cover = cover  # one assignment, as _recount's

    def _recount(self) -> None:
        cover: dict[bytes, float] = {}
        for lease in self._leases.values():
            for h in lease.chain:
                cover[h] = max(cover.get(h, 0.0), lease.expires)
        self._cover = cover  # one assignment: covers() sees the old map or the new one

    # --- the file ----------------------------------------------------------------------------------

    def _read(self) -> dict[bytes, Lease]:
        """The unexpired leases of the file, bounded (see the module's docstring); sets
        _block_bytes from it. A damaged file is set aside and listed in damaged_files."""
        if self.path is None:
            return {}
        remove_leftover_temps(self.path)
        loaded = load_json(self.path, LEASE_SCHEMA, 256 * 1024 * 1024, "leases file")
        if loaded.damaged is not None:
            self.damaged_files.append(loaded.damaged)
        doc = loaded.value or {"leases": {}}
        self._block_bytes = doc.get("block_bytes", 0)
        now = self.clock()
        out = {}
        for tip, raw in doc["leases"].items():
            try:
                joined = bytes.fromhex(raw["chain"])
            except ValueError:
                continue
            chain = tuple(joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES))
            ttl_s = min(raw["ttl_s"], MAX_TTL_S)
            expires = min(raw["expires"], now + ttl_s)
            if chain and len(joined) % HASH_BYTES == 0 and chain[-1].hex() == tip and expires > now:
                out[chain[-1]] = Lease(chain, ttl_s, expires)
        return out

    def _save(self, now: float) -> None:
        """Write the leases (best effort: a lease that cannot be saved still holds until a restart)."""
        self._saved_at = now
        if self.path is None:
            return
        data = json.dumps(
            {
                "version": 1,
                "leases": {
                    tip.hex(): {"chain": b"".join(lease.chain).hex(), "ttl_s": lease.ttl_s, "expires": lease.expires}
                    for tip, lease in self._leases.items()
                },
                "block_bytes": self._block_bytes,
            }
        )
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
            log.warning("leases file %s could not be written (%s); leases hold until a restart", self.path, exc)
