"""One disk budget shared by several namespace folders (the models of one server, registry/registry.py).

Each folder is a FolderUse: a loaded model's live SSDStore, or a folder at rest (its model unloaded, or
found under the cache root at startup). The budget keeps the caps of the live stores plus the bytes of
the folders at rest within `max_bytes`; a live store grows within its cap without asking, and asks
(`reserve`, SSDStore's StoreBudget) when a write would pass it. Room then comes from other folders in
the order a plan gives (registry/ssd_share.py: the idle headroom of other stores, then the least
recently used models' files), each down to its floor: its pinned blocks, which no trim removes.

Contract:
- `attach(store)` counts a live store and sets its cap now (trimming others for it when the folder
  is over its share); `detach(folder)` leaves the folder at rest at its bytes. `hold(folder)` keeps a
  folder out of the plans until it is attached, detached or `hold(folder, False)`: a store shutting
  down (its drain may still write), a folder whose model is loading (its lock is being taken).
- A folder at rest is trimmed by opening it briefly under its folder lock (FolderLock.acquire, role
  BUDGET_ROLE), with its pins and leases read from its files: a folder another process holds is
  skipped (`busy`) and not counted, since its owner budgets it.
- `lend(key, want)` sets bytes aside for a folder another process of this server budgets alone (its
  cap), trimming others for it; counted whole until `give_back(key)`.
- The total (live caps, lent bytes and folders at rest) stays within `max_bytes`, except by pinned bytes: a
  store whose pins pass its cap keeps them and adds nothing more.
- Lock order: the budget's lock, then a store's; a store never calls the budget holding its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from ..leases import LEASES_FILE, PinLeases
from ..pins import PINS_FILE, PinRegistry
from .folder_lock import FolderBusyError, FolderLock
from .store import SSDStore, TrimResult
from .tails import SSDTailStore

log = logging.getLogger(__name__)

BUDGET_ROLE = "ssd budget"  # the role written in a folder's lock while the budget trims it


@dataclass
class FolderUse:
    """One folder's share of the budget; every field is guarded by SSDBudget._lock."""

    folder: Path
    namespace: bytes
    used_bytes: int = 0  # blocks plus tails
    pinned_bytes: int = 0  # the floor (unknown, 0, for a folder at rest never opened)
    cap_bytes: int = 0  # live: its store's max_bytes; at rest: its used_bytes
    last_used: float = 0.0  # the budget's clock at the last touch or reserve
    store: SSDStore | None = None  # while its model is loaded
    held: bool = False  # shutting down or loading: no plan trims it
    busy: bool = False  # at rest and locked by another process at the last try: not counted

    @property
    def is_live(self) -> bool:
        return self.store is not None


class Trim(NamedTuple):
    """Lower `folder`'s cap to `max_bytes` (a live store), or its files (a folder at rest)."""

    folder: Path
    max_bytes: int


# (every folder's use, the folder asking, bytes it still needs) -> the trims to try, in order
TrimPlan = Callable[[Sequence[FolderUse], Path, int], list[Trim]]


class SSDBudget:
    def __init__(self, max_bytes: int, plan: TrimPlan, clock: Callable[[], float] = time.monotonic):
        if max_bytes <= 0:
            raise ValueError("a shared SSD budget needs max_bytes > 0")
        self.max_bytes = max_bytes
        self._plan, self._clock = plan, clock
        self._lock = threading.Lock()  # guards _uses and every FolderUse's fields
        self._uses: dict[Path, FolderUse] = {}
        self.num_trims = 0  # trims that removed files (live or at rest)

    # --- membership -----------------------------------------------------------------------------

    def attach(self, store: SSDStore) -> None:
        """Count `store` (its model was loaded) and set its cap, trimming others for it if needed."""
        with self._lock:
            use = self._uses.get(store.cache_dir)
            if use is not None and use.is_live:
                return  # a second store on one folder is a guest: it evicts nothing and writes little
            usage = store.usage()
            self._uses[store.cache_dir] = FolderUse(
                store.cache_dir, store.namespace, usage.used_bytes, usage.pinned_bytes, usage.used_bytes, self._clock()
            )
            self._uses[store.cache_dir].store = store
            store.budget = self
            self._grant(self._uses[store.cache_dir], 0)

    def hold(self, folder: Path, held: bool = True) -> None:
        """Keep `folder` out of the plans (or let it back in); returns once no trim of it runs."""
        with self._lock:
            use = self._uses.get(folder)
            if use is not None:
                use.held = held

    def detach(self, folder: Path) -> None:
        """Its store stopped: the folder is at rest, at the bytes the store last counted."""
        with self._lock:
            use = self._uses.get(folder)
            if use is None or use.store is None:
                return
            usage = use.store.usage()
            use.store.budget = None
            use.store, use.held = None, False
            use.used_bytes = use.cap_bytes = usage.used_bytes
            use.pinned_bytes = usage.pinned_bytes

    def add_folder(self, folder: Path, namespace: bytes, last_used: float) -> bool:
        """Count a folder at rest found under the cache root (measured under its lock; one found busy
        before is measured again). False when another process holds it (not counted) or it cannot
        be read."""
        with self._lock:
            known = self._uses.get(folder)
            if known is not None and not known.busy:
                return True
            use = known or FolderUse(folder, namespace, last_used=last_used)
            if self._trim_at_rest(use, None) is None:
                return False
            self._uses[folder] = use
            return True

    def touch(self, folder: Path) -> None:
        """Its model was used now (the LRU order of the plans)."""
        with self._lock:
            if folder in self._uses:
                self._uses[folder].last_used = self._clock()

    def lend(self, key: Path, want: int) -> int:
        """Set aside up to `want` bytes for a folder another process of this server budgets alone (a
        model in a process of its own: `key` names it, its folder is not known here): other folders
        are trimmed for it as for a store asking room. Counted whole and never trimmed until
        `give_back(key)`. Returns the bytes lent, the cap that process keeps its folder within."""
        with self._lock:
            use = FolderUse(key, b"", last_used=self._clock(), held=True)
            self._uses[key] = use
            self._refresh()
            room = self._make_room(use, want)
            use.used_bytes = use.cap_bytes = max(0, min(room, want))  # pins may leave nothing
            return use.cap_bytes

    def give_back(self, key: Path) -> None:
        """That process ended: its lent bytes are free (its folder, at rest now, is counted by the
        next add_folder)."""
        with self._lock:
            self._uses.pop(key, None)

    # --- room -----------------------------------------------------------------------------------

    def reserve(self, store: SSDStore, num_bytes: int) -> None:
        """StoreBudget: room for `num_bytes` more in `store`, made by the plan's trims of other
        folders; the store's cap becomes its use plus what it needs plus a share of what is free."""
        with self._lock:
            use = self._uses.get(store.cache_dir)
            if use is None or use.store is not store:
                return
            use.last_used = self._clock()
            self._grant(use, num_bytes)

    def _grant(self, use: FolderUse, num_bytes: int) -> None:
        """Set `use`'s cap (lock held). Each pass asks the plan for the trims that would free what is
        missing; a pass that frees nothing ends it (pins, busy folders): the store then evicts its own."""
        self._refresh()
        want = use.used_bytes + num_bytes
        room = self._make_room(use, want)
        live = sum(1 for u in self._uses.values() if u.is_live and not u.held)
        share = max(0, room - want) // max(1, live)
        cap = min(room, want + share) if room >= want else room
        use.used_bytes, use.pinned_bytes, _ = use.store.trim_to(cap)
        use.cap_bytes = max(cap, use.used_bytes)  # pins may keep it above: they count

    def _make_room(self, use: FolderUse, want: int) -> int:
        """Trim other folders as the plan says until `use` has room for `want` bytes, or a pass
        frees nothing (pins, busy folders); the room it has then (lock held)."""
        for _ in range(len(self._uses) + 1):
            missing = want - self._room(use)
            if missing <= 0:
                break
            before = self._counted()
            for trim in self._plan(self._snapshot(), use.folder, missing):
                self._apply(trim)
                if self._room(use) >= want:
                    break
            if self._counted() >= before:
                break
        return self._room(use)

    def _room(self, use: FolderUse) -> int:
        """What `use` may hold: the budget less every other counted folder (lock held)."""
        return self.max_bytes - (self._counted() - use.cap_bytes)

    def _counted(self) -> int:
        return sum(u.cap_bytes for u in self._uses.values() if not u.busy)

    def _refresh(self) -> None:
        for use in self._uses.values():
            if use.store is not None:
                use.used_bytes, use.pinned_bytes, _ = use.store.usage()

    def _snapshot(self) -> list[FolderUse]:
        return [replace(u) for u in self._uses.values() if not u.busy]  # copies: a plan only reads them

    def _apply(self, trim: Trim) -> None:
        use = self._uses.get(trim.folder)
        if use is None or use.held or trim.max_bytes >= use.cap_bytes:
            return
        if use.store is not None:
            result = use.store.trim_to(trim.max_bytes)
            use.cap_bytes = max(trim.max_bytes, result.used_bytes)  # pins may keep it above
        else:
            result = self._trim_at_rest(use, trim.max_bytes)
        if result is not None:
            use.used_bytes, use.pinned_bytes = result.used_bytes, result.pinned_bytes
            if result.evicted:
                self.num_trims += 1
                log.info("SSD budget: trimmed %s to %.1f MiB", use.folder.name, result.used_bytes / 2**20)

    def _trim_at_rest(self, use: FolderUse, max_bytes: int | None) -> TrimResult | None:
        """Open a folder at rest under its lock, trim it to `max_bytes` (None: only measure) with its
        pins and leases honoured, write its index, let it go. None (and `busy`) when another process
        holds it; None when it cannot be read (logged)."""
        try:
            lock = FolderLock.acquire(use.folder, BUDGET_ROLE)
        except FolderBusyError:
            use.busy = True
            return None
        except OSError as exc:
            log.warning("SSD budget: cannot lock %s (%s)", use.folder, exc)
            return None
        try:
            pins = PinRegistry(use.folder / PINS_FILE, PinLeases(use.folder / LEASES_FILE))
            store = SSDStore(use.folder, use.namespace, is_pinned=pins.is_pinned)
            store.attach_secondary(SSDTailStore(use.folder / "tails", use.namespace))
            result = store.usage() if max_bytes is None else store.trim_to(max_bytes)
            store.flush()
        except OSError as exc:
            log.warning("SSD budget: cannot trim %s (%s)", use.folder, exc)
            return None
        finally:
            lock.release()
        use.busy = False
        use.used_bytes = use.cap_bytes = result.used_bytes
        use.pinned_bytes = result.pinned_bytes
        return result

    # --- reading --------------------------------------------------------------------------------

    def used_of(self, folder: Path) -> int | None:
        """The folder's bytes (a live store's now), or None when the budget does not count it."""
        with self._lock:
            use = self._uses.get(folder)
            if use is None or use.busy:
                return None
            return use.store.usage().used_bytes if use.store is not None else use.used_bytes

    def describe(self) -> dict[str, int]:
        with self._lock:
            self._refresh()
            counted = [u for u in self._uses.values() if not u.busy]
            return {
                "ssd_budget_bytes": self.max_bytes,
                "ssd_used_bytes": sum(u.used_bytes for u in counted),
                "ssd_pinned_bytes": sum(u.pinned_bytes for u in counted),
                "ssd_budget_trims": self.num_trims,
            }

    def check_integrity(self) -> None:
        """Raise AssertionError unless the counted folders fit the budget (pins aside) and every live
        store holds within its cap. Call when idle."""
        with self._lock:
            self._refresh()
            counted = [u for u in self._uses.values() if not u.busy]
            for use in counted:
                if use.store is not None:
                    assert use.used_bytes <= max(use.cap_bytes, use.pinned_bytes), f"{use.folder.name} over its cap"
            over = sum(u.used_bytes for u in counted) - self.max_bytes
            assert over <= sum(u.pinned_bytes for u in counted), "over the shared budget beyond its pins"
