"""Progress bars for the waits of the commands (`cache verify`, `convert`, the first model's conversion):
tqdm, written to stderr and only on a terminal, so logs, pipes and tests see none of it."""

from __future__ import annotations

from typing import Any


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar of `total` steps (use as a context manager, `.update(n)` per step); off unless stderr
    is a terminal (disable=None)."""
    from tqdm import tqdm  # huggingface_hub's dependency too; imported when a command needs it

    return tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False, dynamic_ncols=True)
