"""Long contexts on a CPU for the benches (issue 44 item 4): a compute-free attention, the floor of one
memory copy of a prefix, a process's peak RSS during one request, and the table
of them in the lengths scenario (bench_engine.py lengths)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

LONG_MEDIANS = ("copy_floor_s", "repeat_over_copy", "new_question_over_copy", "rss_growth_over_prefix")
COPY_PROBE_BYTES = 512 << 20  # far past any CPU cache: the copy runs at memory speed, not cache speed


def compute_free_attention(queries, keys, values, cache=None, scale=1.0, mask=None, **_):
    """The keys and values are in the cache already (update_and_fetch ran): skip the scores, so a
    128k-token prefill is not hours of O(n^2) work on a CPU while the KV is still held at its real size."""
    return queries


def make_compute_free() -> None:
    """Every llama built from now on attends compute-free (the long-context journey uses it too)."""
    from mlx_lm.models import llama

    llama.scaled_dot_product_attention = compute_free_attention


def memory_copy_bps(nbytes: int = COPY_PROBE_BYTES, reps: int = 3) -> float:
    """Bytes per second of one plain memory copy (numpy, the fastest of `reps`): a hit's floor is
    the prefix's bytes at this speed, as it must land in the request's cache once."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_rss_during(run) -> tuple[object, int, int]:
    """(run()'s result, RSS bytes before it, peak RSS bytes while it ran). Linux only: the peak is
    reset by writing 5 to /proc/self/clear_refs; elsewhere both are 0."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS") * 1024
    except OSError:
        return run(), 0, 0
    result = run()
    return result, before, _status_kib("VmHWM") * 1024


def copy_floor(row: dict, prefix_bytes: int) -> dict:
    """The hits against one memory copy of the prefix (timed now, between the sides), and the peak RSS
    the exact repeat added over the RSS before it (the RAM blocks were in it) against one such copy."""
    copy_s = prefix_bytes / memory_copy_bps()
    growth = row["rss_peak_repeat_bytes"] - row["rss_before_repeat_bytes"]
    return {
        "copy_floor_s": copy_s,
        "repeat_over_copy": row["repeat_s"] / copy_s,
        "new_question_over_copy": row["ram_hit_s"] / copy_s,
        "rss_growth_over_prefix": growth / prefix_bytes,
    }


def long_lines(results: dict, question_tokens: int) -> list[str]:
    """Issue 44 item 4, compute-free: every case of a length against its floor and mlx-lm's, with the
    peak RSS the exact repeat added (at most one copy of the prefix over the RAM blocks already held)."""
    lines = [
        "",
        "Long contexts (compute-free attention): hits against one memory copy of the prefix (copy s), the restore "
        "against the raw cold read + the RAM hit; mlx-lm's one-cache path beside; RSS growth during the exact repeat.",
        "",
        "| prompt tokens | prefix GiB | cold s: ours / mlx-lm | exact repeat s: ours / mlx-lm | new question s: "
        "ours / mlx-lm | copy s | repeat / copy | new / copy | restore s / floor s | x floor "
        "| RAM blocks GiB | RSS before / peak GiB | growth / prefix |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gib, kv = 2**30, results["machine"]["kv_bytes_per_token"]
    for row in results["lengths"]:
        rep = row["reps"][0]
        lines.append(
            f"| {row['prompt_tokens']} | {kv * (row['prompt_tokens'] - question_tokens) / gib:.2f} "
            f"| {row['cold_s']:.2f} / {row['mlx_lm_cold_s']:.2f} | {row['repeat_s']:.3f} / {row['mlx_lm_repeat_s']:.3f} "
            f"| {row['ram_hit_s']:.3f} / {row['mlx_lm_new_question_s']:.3f} | {row['copy_floor_s']:.3f} "
            f"| {row['repeat_over_copy']:.1f}x | {row['new_question_over_copy']:.1f}x "
            f"| {row['restore_s']:.3f} / {row['restore_floor_s']:.3f} | {row['restore_over_floor']:.2f}x "
            f"| {rep['ram_blocks_bytes'] / gib:.2f} | {rep['rss_before_repeat_bytes'] / gib:.2f} / "
            f"{rep['rss_peak_repeat_bytes'] / gib:.2f} | {row['rss_growth_over_prefix']:.2f} |"
        )
    return lines
