"""The shutdown record: how the SSD tier's last run ended (clean, or with a partial flush), written by
its close and read, then removed, by the next start (so a crash of that run shows too)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ...checked_json import Bool, DamagedFile, Obj, load_json, remove_leftover_temps
from ...fsmode import open_private

log = logging.getLogger(__name__)

SHUTDOWN_FILE = "shutdown.json"
MAX_SHUTDOWN_RECORD_BYTES = 64 * 1024
SHUTDOWN_SCHEMA = Obj({"shutdown_clean": Bool(), "shutdown_partial_flush": Bool()})  # "at" is not used


def write_shutdown_record(cache_dir: Path, clean: bool, partial_flush: bool) -> None:
    record = {"shutdown_clean": clean, "shutdown_partial_flush": partial_flush, "at": time.time()}
    tmp = cache_dir / f".{SHUTDOWN_FILE}.tmp"
    try:
        with open_private(tmp, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, cache_dir / SHUTDOWN_FILE)
    except OSError as exc:  # e.g. a full disk: the next start then reports an unclean shutdown
        log.error("cannot record the shutdown in %s: %s", cache_dir, exc)


def read_shutdown_record(
    cache_dir: Path, damaged: list[DamagedFile] | None = None, consume: bool = True
) -> dict[str, bool | None]:
    """How the previous run ended: exactly `shutdown_clean` and `shutdown_partial_flush`, each a
    bool, or None when there is no record (the previous run crashed, or none ran here). The record
    is removed on reading (unless not `consume`: `cache verify`), so a crash of this run is visible
    to the next one. A damaged record reads as not clean: it is set aside and appended to
    `damaged`. Temp files of an interrupted record write are removed."""
    path = cache_dir / SHUTDOWN_FILE
    remove_leftover_temps(path)
    loaded = load_json(path, SHUTDOWN_SCHEMA, MAX_SHUTDOWN_RECORD_BYTES, "shutdown record")
    if loaded.damaged is not None and damaged is not None:
        damaged.append(loaded.damaged)
    if loaded.value is None:
        return {"shutdown_clean": False if loaded.damaged else None, "shutdown_partial_flush": None}
    if consume:
        try:
            path.unlink()
        except OSError as exc:  # it would outlive this run, and a crash of this run would look clean
            log.warning("cannot remove the shutdown record %s (%s): reported as not clean", path, exc)
            return {"shutdown_clean": False, "shutdown_partial_flush": None}
    record = loaded.value  # only the checked fields: nothing else in the file reaches /health
    return {"shutdown_clean": record["shutdown_clean"], "shutdown_partial_flush": record["shutdown_partial_flush"]}
