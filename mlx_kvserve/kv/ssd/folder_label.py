"""`model.json` in a store folder: the name of the model whose blocks it holds, written by the
folder's owner at start, so that `mlx-kvserve cache verify` names models rather than namespace ids.
Only a label: nothing reads it to decide anything (the namespace in the index and block headers does)."""

from __future__ import annotations

import json
from pathlib import Path

from ...checked_json import Obj, Str, read_json
from .format import atomic_write

LABEL_FILE = "model.json"
_MAX_BYTES = 16 * 1024
_SCHEMA = Obj({"model": Str(1024)}, optional={"path": Str(4096)})


def write_label(folder: Path, model: str, path: str) -> None:
    """Record `model` (the served name) and its `path` unless the file says so already. Raises OSError."""
    if read_label(folder) == model:
        return
    atomic_write(folder / LABEL_FILE, json.dumps({"model": model, "path": path}).encode())


def read_label(folder: Path) -> str | None:
    """The model named in the folder's label; None when there is none or it cannot be read."""
    try:
        return read_json(folder / LABEL_FILE, _SCHEMA, _MAX_BYTES)["model"]
    except (OSError, ValueError):
        return None
