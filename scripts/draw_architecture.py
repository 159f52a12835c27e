"""Draw docs/img/architecture.png: the request path and the cache tiers (matplotlib, no data).

Usage: .venv/bin/python scripts/draw_architecture.py [--out docs/img/architecture.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

HTTP, WORKER, CACHE, DISK, BG = "#dbe9f6", "#fde9c9", "#d9f0d3", "#e6dcf0", "#f2f2f2"


def box(ax, x, y, w, h, title, body="", color=CACHE, size=9):
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=color, ec="#444", lw=1.0)
    )
    ax.text(x + w / 2, y + h - 0.17, title, ha="center", va="top", fontsize=size, weight="bold")
    if body:
        ax.text(x + w / 2, y + h - 0.47, body, ha="center", va="top", fontsize=size - 1.5, linespacing=1.35)


def arrow(ax, start, end, label="", color="#333", style="-|>", ls="-", offset=(0.08, 0.0)):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=1.2, linestyle=ls))
    if label:
        mx_, my = (start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1]
        ax.text(mx_, my, label, fontsize=7.2, color=color, ha="left", va="center")


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(14, 9.6))
    ax.set_xlim(0, 14)
    ax.set_ylim(-0.1, 9.6)
    ax.axis("off")
    ax.text(0.1, 9.4, "mlx-kvserve: request path and KV cache tiers", fontsize=13, weight="bold", va="top")

    # HTTP layer (asyncio event loop)
    ax.add_patch(FancyBboxPatch((0.1, 6.85), 13.8, 2.1, boxstyle="round,pad=0.02", fc=BG, ec="#999", lw=0.8))
    ax.text(0.25, 8.85, "asyncio event loop (uvicorn + Starlette)", fontsize=8, style="italic", va="top")
    box(ax, 0.3, 7.0, 2.0, 1.55, "client", "OpenAI SDK, curl,\nany HTTP client", "#ffffff")
    box(ax, 2.9, 7.0, 2.6, 1.55, "gate", "API keys (401/403)\nin-flight limit (429)\nbody size (413), logs", HTTP)
    box(
        ax,
        6.1,
        7.0,
        3.0,
        1.55,
        "CompletionHandler",
        "parse + validate (4xx)\nchat template -> token ids\nbudget, deadlines (504)",
        HTTP,
    )
    box(ax, 9.7, 7.0, 1.9, 1.55, "/v1/cache", "pin, unpin, pins,\nstats, flush, prune", HTTP)
    box(ax, 12.0, 7.0, 1.8, 1.55, "/health, /metrics", "tiers, writer,\nshutdown record", HTTP, size=8)
    arrow(ax, (2.3, 7.78), (2.9, 7.78))
    arrow(ax, (5.5, 7.78), (6.1, 7.78))

    # Worker thread
    ax.add_patch(FancyBboxPatch((0.1, 3.55), 8.2, 3.05, boxstyle="round,pad=0.02", fc=BG, ec="#999", lw=0.8))
    ax.text(0.25, 6.5, 'the one MLX thread ("mlx-worker"): continuous batching', fontsize=8, style="italic", va="top")
    box(ax, 0.3, 4.95, 2.4, 1.3, "InferenceWorker", "bounded queue\n(full: 429)\ncached-first order", WORKER)
    box(ax, 0.3, 3.7, 2.4, 1.05, "kv/blocks.py", "mlx-lm cache <-> blocks:\nslice, assemble", WORKER, size=8)
    box(
        ax,
        3.1,
        3.7,
        4.9,
        2.55,
        "Scheduler  (engine/batch/scheduler.py)",
        "1. start order: fewest uncached tokens first, waits bounded\n"
        "2. PrefixCache.prepare: lookup, assemble the match\n"
        "    (block hashes computed once per request)\n"
        "3. mlx-lm BatchGenerator: prefill chunks + batched\n"
        "    decode; stop strings, eos, cancel\n"
        "4. PrefixCache.register / finish: new blocks and tails\n"
        "    -> KVManager; release the request's blocks",
        WORKER,
    )
    arrow(ax, (6.6, 7.0), (1.9, 6.25), "GenerationRequest", offset=(-2.6, 0.05))
    arrow(ax, (2.7, 5.6), (3.1, 5.6))
    arrow(ax, (3.1, 4.25), (2.7, 4.25))
    arrow(
        ax, (7.4, 6.25), (8.2, 7.0), "TextDelta, Finished\n(call_soon_threadsafe)", color="#1f5fa8", offset=(0.15, -0.1)
    )

    # Cache tiers
    box(
        ax,
        9.0,
        4.35,
        4.85,
        1.9,
        "KVManager  (kv/manager.py)",
        "chained blake3 block hashes, token check on every hit\nrefs (in use: never evicted), pins (pins.json)\n"
        "evict: pinned share -> unpinned LRU -> demote pinned\nlookup: RAM -> SSD (promoted) -> tail",
        CACHE,
    )
    arrow(ax, (8.0, 5.3), (9.0, 5.3))
    ax.text(8.05, 5.75, "lookup\ncache_block\nrelease", fontsize=7, va="center")
    arrow(ax, (10.65, 7.0), (10.65, 6.25), "pin, flush", offset=(0.08, 0.0))
    box(ax, 9.0, 2.4, 2.1, 1.45, "RAMStore", "full blocks, LRU\n7/8 of ram_max_bytes", CACHE, size=8.5)
    box(ax, 11.75, 2.4, 2.1, 1.45, "TailStore", "partial last blocks\n1/8 of ram_max_bytes", CACHE, size=8.5)
    arrow(ax, (10.0, 4.35), (10.0, 3.85))
    arrow(ax, (12.8, 4.35), (12.8, 3.85))
    arrow(ax, (11.42, 4.35), (11.42, 2.15), color="#6a3d9a")
    ax.text(
        11.42,
        3.1,
        "next tier",
        fontsize=7,
        color="#6a3d9a",
        rotation=90,
        ha="center",
        va="center",
        bbox={"fc": "white", "ec": "none", "pad": 1},
    )

    # SSD
    box(
        ax,
        0.3,
        0.6,
        4.6,
        2.3,
        "SSDStore  (kv/ssd/store.py, kv/ssd/index.py)",
        "<cache_dir>/<namespace>/<hh>/<hash>.safetensors\n+ tails/, index.json, pins.json, shutdown.json\n"
        "xxh3-128 checksum; temp + fsync + rename\ncorrupt, foreign, truncated -> miss + deleted\n"
        "disk budget, TTL, free-space floor",
        DISK,
    )
    box(
        ax,
        5.3,
        0.6,
        3.3,
        2.3,
        "SSDWriterThread",
        '"ssd-writer", non-daemon, nice +10\nbounded queue, pending dedup\nheld while a request prefills\n'
        "sentinel-last drain at shutdown",
        DISK,
    )
    box(
        ax,
        9.0,
        0.6,
        4.85,
        1.55,
        "SSDTier  (kv/ssd/tier.py)",
        "write_through | evict_only\nreads on the worker thread, verified, promoted",
        DISK,
    )
    arrow(ax, (9.0, 1.5), (8.6, 1.5), color="#6a3d9a")
    arrow(ax, (5.3, 1.5), (4.9, 1.5), color="#6a3d9a")
    ax.text(4.93, 1.7, "save", fontsize=7, color="#6a3d9a")
    ax.add_patch(
        FancyArrowPatch(
            (10.2, 0.6),
            (2.6, 0.6),
            arrowstyle="-|>",
            mutation_scale=12,
            color="#6a3d9a",
            lw=1.2,
            linestyle="--",
            connectionstyle="bar,fraction=-0.04",
        )
    )
    ax.text(6.4, 0.12, "load_block: read and verified on the worker thread", fontsize=7, color="#6a3d9a", ha="center")

    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "architecture.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
