"""Compute the front of an SSD hit while its back is read (issue 14, item 3).

A prompt whose cached prefix is on the SSD (after a restart, or evicted from RAM) has two ways to
get it: read the blocks, or prefill them again. Doing both at once is faster than either: the
model prefills the first blocks (computing from the front) while the SSD tier reads the rest
(loading from the back), and the two meet where their times are equal. KVManager.lookup drives
it; this is the engine's half: how many blocks to compute (from the measured read and prefill
speeds) and the prefill itself. The computed blocks are the same hashes as the stored ones, so
they join RAM like loaded blocks, and the output is the cold run's whatever the split.

Only for caches that are plain per-position KV: a recurrent state or a sliding window cannot be
computed for a stretch of the prompt without everything before it being its own checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...checked_json import DamagedFile, Float, Obj, load_json
from ...kv.blocks import CacheLayout
from ...kv.ssd import atomic_write

log = logging.getLogger(__name__)

# The speeds measured by the last run, kept in the cache folder: the first SSD hit after a restart
# (the case this is for) comes before this run has measured anything.
SPEEDS_FILE = "speeds.json"
# Speeds outside these bounds are not measurements (a subnormal speed once made every split a
# division of infinities): the file's are refused (set aside), this run's are ignored.
READ_BOUNDS = (1e-3, 1e7)  # blocks read per second
PREFILL_BOUNDS = (1e-3, 1e9)  # tokens prefilled per second
SPEEDS_SCHEMA = Obj({"blocks_read_per_s": Float(*READ_BOUNDS), "prefill_tokens_per_s": Float(*PREFILL_BOUNDS)})


class FrontPrefill:
    """`blocks_read_per_s()` and `prefill_tokens_per_s()` report the speeds measured so far (None
    before any), else those the last run measured (`remember`); without both, nothing is computed
    (every block is read). `forced_share`, when set, computes that share of the stored blocks
    whatever the speeds (tests, benchmarks)."""

    def __init__(
        self,
        model: Any,
        layout: CacheLayout,
        block_size: int,
        step_size: int,
        blocks_read_per_s: Callable[[], float | None],
        prefill_tokens_per_s: Callable[[], float | None],
    ):
        self.model = model
        self.layout = layout
        self.block_size = block_size
        self.step_size = max(1, step_size)
        self.blocks_read_per_s = blocks_read_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.forced_share: float | None = None
        self._remembered: dict[str, float] = {}
        self.damaged_files: list[DamagedFile] = []  # a speeds file found damaged (and set aside)

    def speeds(self) -> tuple[float | None, float | None]:
        """(blocks read per second, prefill tokens per second): this run's, else the last run's;
        None where neither is within its bounds."""
        read = _bounded(self.blocks_read_per_s(), READ_BOUNDS) or self._remembered.get("blocks_read_per_s")
        prefill = _bounded(self.prefill_tokens_per_s(), PREFILL_BOUNDS) or self._remembered.get("prefill_tokens_per_s")
        return read, prefill

    def remember(self, path: Path) -> None:
        """Take the speeds the last run saved at `path` (a damaged file, or one with a speed out of
        bounds, is set aside, listed in damaged_files and ignored)."""
        loaded = load_json(path, SPEEDS_SCHEMA, 4096, "measured speeds")
        self._remembered = loaded.value or {}
        if loaded.damaged is not None:
            self.damaged_files.append(loaded.damaged)

    def save(self, path: Path) -> None:
        """Keep the speeds for the next run (nothing when nothing was measured)."""
        read, prefill = self.speeds()
        if not read or not prefill:
            return
        try:
            atomic_write(path, json.dumps({"blocks_read_per_s": read, "prefill_tokens_per_s": prefill}).encode())
        except OSError as exc:
            log.warning("cannot keep the measured speeds in %s: %s", path, exc)

    def wants_a_read_sample(self) -> bool:
        """True when the prefill speed is known but no read was ever measured (the first SSD hit
        after the first restart): reading one block then gives the speed to split the rest by."""
        read, prefill = self.speeds()
        return self.forced_share is None and not read and bool(prefill)

    def blocks_to_compute(self, start: int, stored: int) -> int:
        """Balance the two: computing k blocks takes k * block_size / prefill speed, reading the
        other stored - k takes (stored - k) / read speed; the time to the prefix is the larger,
        least where they are equal. Rounded down: reading is the cheaper side to overshoot."""
        if self.forced_share is not None:
            return min(stored, int(stored * self.forced_share))
        read, prefill = self.speeds()
        if not read or not prefill:
            return 0
        compute_s, read_s = self.block_size / prefill, 1.0 / read  # finite and positive: speeds() bounds them
        return max(0, min(stored, int(stored * read_s / (compute_s + read_s) + 1e-9)))

    def compute(self, tokens: Sequence[int], before: Sequence[Any], start: int, count: int) -> list[tuple[Any, int]]:
        """Prefill blocks start..start+count-1 on top of `before` (the payloads of the blocks
        before them) in `step_size` chunks, and cut them out of the cache as block payloads."""
        bs = self.block_size
        cache = self.layout.assemble(list(before), room=count * bs)
        ids = list(tokens[start * bs : (start + count) * bs])
        for lo in range(0, len(ids), self.step_size):
            self.model(mx.array(ids[lo : lo + self.step_size])[None], cache=cache)  # logits unused: never evaluated
            mx.eval([c.state for c in cache])
        return self.layout.slice_blocks(cache, start, start + count, bs)


def _bounded(value: float | None, bounds: tuple[float, float]) -> float | None:
    """`value` when it is a finite number within `bounds`, else None."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and bounds[0] <= value <= bounds[1]
    return float(value) if ok else None
