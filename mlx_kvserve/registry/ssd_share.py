"""One SSD budget (`[ssd] max_bytes`) across the models of a registry (registry/registry.py): the models'
namespace folders share it through kv/ssd/budget.py's SSDBudget; this module holds the policy (which
folder gives room first: `lru_trims`) and the registry's side (which folder is whose).

Policy: when a model's store needs room, the idle headroom of the other loaded stores goes first (it
costs nothing), then the files of the least recently used models (loaded or not, the folders found
under the cache root at startup being the oldest of all), each down to its pinned blocks. The model
asking comes last: its own store evicts its least recently used files when the others cannot give.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import Config
from ..kv.ssd.budget import FolderUse, SSDBudget, Trim
from ..kv.ssd.index import INDEX_NAME, folder_namespace

log = logging.getLogger(__name__)


def lru_trims(uses: Sequence[FolderUse], asking: Path, need: int) -> list[Trim]:
    """The trims that free `need` bytes for `asking`, as far as the uses say (pure: state in,
    decision out). Headroom of live stores first, then files least recently used first, never
    below a folder's pinned bytes; held folders (unloading, loading) are left alone. May free less than
    `need`."""
    others = [u for u in uses if u.folder != asking and not u.held]
    target = {u.folder: u.cap_bytes for u in others}
    order: list[Path] = []
    left = need
    for use in others:  # headroom: a live store's cap above its use
        take = min(left, max(0, use.cap_bytes - use.used_bytes))
        if take > 0:
            target[use.folder] -= take
            order.append(use.folder)
            left -= take
    for use in sorted(others, key=lambda u: u.last_used):
        if left <= 0:
            break
        take = min(left, max(0, target[use.folder] - use.pinned_bytes))
        if take > 0:
            target[use.folder] -= take
            if use.folder not in order:
                order.append(use.folder)
            left -= take
    return [Trim(folder, target[folder]) for folder in order]


def engine_store(engine: Any) -> Any:
    """The SSDStore of a loaded engine, or None (no SSD tier, an embedding model, a test double)."""
    tier = getattr(getattr(engine, "prefix_cache", None), "ssd_tier", None)
    return getattr(tier, "store", None)


class RegistrySSD:
    """The registry's view of the shared budget: each model's folder (known once it was loaded),
    the folders at rest under the cache root, and the budget's figures for /health and /v1/models."""

    def __init__(self, config: Config, clock: Any = time.monotonic):
        self.budget = SSDBudget(config.ssd.max_bytes, lru_trims, clock)
        self.folders: dict[str, Path] = {}  # model name -> its namespace folder (once loaded)
        self.process_folders: dict[str, Path] = {}  # the same for models in a process of their own
        self._root, self._clock = config.ssd_path(), clock
        self._discover(self._root, clock)

    @classmethod
    def for_config(cls, config: Config) -> RegistrySSD | None:
        """A shared budget when [ssd] is on with a max_bytes; None otherwise (no budget to share)."""
        if not (config.cache.enabled and config.ssd.enabled and config.ssd.max_bytes > 0):
            return None
        return cls(config)

    def _discover(self, root: Path, clock: Any) -> None:
        """Count the store folders under the cache root (those of earlier runs): at rest, as old as
        their index says. A folder another process holds is its owner's to budget."""
        if not root.is_dir():
            return
        now_wall, now = time.time(), clock()
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            namespace = folder_namespace(folder)
            if namespace is None:
                continue
            try:
                age = now_wall - (folder / INDEX_NAME).stat().st_mtime
            except OSError:
                age = 0.0
            if not self.budget.add_folder(folder, namespace, now - max(0.0, age)):
                log.info("SSD budget: %s is held by another process; not counted", folder)

    def lend(self, name: str, config: Config, num_models: int) -> Config:
        """`name` is served by a process of its own (server/model_process.py), which budgets its
        folder alone: it gets a share of the budget (`max_bytes` over the number of models, others
        trimmed for it least recently used first, within what pins leave) as its `ssd.max_bytes`,
        counted here whole until `returned(name)`. The config that process starts with."""
        cap = self.budget.lend(self._lent_key(name), self.budget.max_bytes // max(1, num_models))
        return replace(config, ssd=replace(config.ssd, max_bytes=max(1, cap)))

    def returned(self, name: str) -> None:
        """`name`'s process ended: its share is free and its folder, at rest now, is counted."""
        self.budget.give_back(self._lent_key(name))
        self._discover(self._root, self._clock)

    def _lent_key(self, name: str) -> Path:
        return self._root / f"<process of {name}>"  # never a folder: names the lent share

    def loaded(self, name: str, engine: Any) -> None:
        """`name`'s engine started: its store joins the budget (and gets its cap now). A model in a
        process of its own budgets its folder alone: only its folder is learned, so that its bytes
        at rest are known once its process ends."""
        store = engine_store(engine)
        if store is None:
            folder = engine.ssd_folder() if callable(getattr(engine, "ssd_folder", None)) else None
            if folder is not None:
                self.process_folders[name] = folder
            return
        self.folders[name] = store.cache_dir
        self.budget.attach(store)

    def hold(self, name: str, held: bool = True) -> None:
        """Keep `name`'s folder (when known) out of the trims while it loads or unloads."""
        if name in self.folders:
            self.budget.hold(self.folders[name], held)

    def unloaded(self, name: str) -> None:
        if name in self.folders:
            self.budget.detach(self.folders[name])

    def used(self, name: str) -> None:
        if name in self.folders:
            self.budget.touch(self.folders[name])

    def bytes_of(self, name: str) -> int | None:
        """`name`'s folder's bytes as the budget counts them (at rest once its process ended)."""
        folder = self.folders.get(name) or self.process_folders.get(name)
        return self.budget.used_of(folder) if folder is not None else None
