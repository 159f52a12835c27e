"""Draw docs/architecture.md's pictures (matplotlib, no data): docs/img/packages.png, the packages and their
imports read from the code (every import statement of mlx_kvserve/, deferred ones included), and
docs/img/architecture.png, the request path and the cache tiers.

Usage: .venv/bin/python scripts/draw_architecture.py [--out-dir docs/img]
(an import against the layers, from a lower box to a higher one, is drawn red and printed; `--check` only checks,
without matplotlib: every package has a place in the picture and no import goes against the layers)
"""

from __future__ import annotations

import argparse
import ast
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

# matplotlib (the `bench` extra) is imported only to draw (use_matplotlib): `--check` runs without it, as in CI.
plt: Any = None
FancyArrowPatch: Any = None
FancyBboxPatch: Any = None

ROOT = Path(__file__).resolve().parents[1]

HTTP, WORKER, CACHE, DISK, BG = "#dbe9f6", "#fde9c9", "#d9f0d3", "#e6dcf0", "#f2f2f2"


def use_matplotlib() -> None:
    global plt, FancyArrowPatch, FancyBboxPatch
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    from matplotlib import patches

    plt, FancyArrowPatch, FancyBboxPatch = pyplot, patches.FancyArrowPatch, patches.FancyBboxPatch


def box(ax, x, y, w, h, title, body="", color=CACHE, size=9):
    rounded = "round,pad=0.02,rounding_size=0.12"
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=rounded, fc=color, ec="#444", lw=1.0))
    ax.text(x + w / 2, y + h - 0.17, title, ha="center", va="top", fontsize=size, weight="bold")
    if body:
        ax.text(x + w / 2, y + h - 0.47, body, ha="center", va="top", fontsize=size - 1.5, linespacing=1.35)


def arrow(ax, start, end, label="", color="#333", style="-|>", ls="-", offset=(0.08, 0.0)):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=1.2, linestyle=ls))
    if label:
        mx_, my = (start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1]
        ax.text(mx_, my, label, fontsize=7.2, color=color, ha="left", va="center")


def draw_request_path(out: Path) -> None:
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
    handler = "parse + validate (4xx)\nchat template -> token ids\nbudget, deadlines (504)"
    box(ax, 6.1, 7.0, 3.0, 1.55, "CompletionHandler", handler, HTTP)
    box(ax, 9.7, 7.0, 1.9, 1.55, "/v1/cache", "pin, unpin, pins,\nstats, flush, prune", HTTP)
    box(ax, 12.0, 7.0, 1.8, 1.55, "/health, /metrics", "tiers, writer,\nshutdown record", HTTP, size=8)
    arrow(ax, (2.3, 7.78), (2.9, 7.78))
    arrow(ax, (5.5, 7.78), (6.1, 7.78))

    # Worker thread
    ax.add_patch(FancyBboxPatch((0.1, 3.55), 8.2, 3.05, boxstyle="round,pad=0.02", fc=BG, ec="#999", lw=0.8))
    ax.text(0.25, 6.5, 'the one MLX thread ("mlx-worker"): continuous batching', fontsize=8, style="italic", va="top")
    box(ax, 0.3, 4.95, 2.4, 1.3, "InferenceWorker", "bounded queue\n(full: 429)\nthe mlx-worker thread", WORKER)
    box(ax, 0.3, 3.7, 2.4, 1.05, "kv/blocks.py", "mlx-lm cache <-> blocks:\nslice, assemble runs", WORKER, size=8)
    steps = (
        "1. start order: fewest uncached tokens first, waits bounded\n"
        "2. PrefixCache.prepare: lookup, assemble the match\n"
        "    (block hashes computed once per request)\n"
        "3. mlx-lm BatchGenerator: prefill chunks + batched\n"
        "    decode; stop strings, eos, cancel\n"
        "4. PrefixCache.register / finish: new blocks and tails\n"
        "    -> KVManager; release the request's blocks"
    )
    box(ax, 3.1, 3.7, 4.9, 2.55, "Scheduler  (engine/batch/scheduler.py)", steps, WORKER)
    arrow(ax, (6.6, 7.0), (1.9, 6.25), "GenerationRequest", offset=(-2.6, 0.05))
    arrow(ax, (2.7, 5.6), (3.1, 5.6))
    arrow(ax, (3.1, 4.25), (2.7, 4.25))
    replies = "TextDelta, Finished\n(call_soon_threadsafe)"
    arrow(ax, (7.4, 6.25), (8.2, 7.0), replies, color="#1f5fa8", offset=(0.15, -0.1))

    # Cache tiers
    manager = (
        "chained blake3 block hashes, token check on every hit\nrefs (in use: never evicted), pins (pins.json)\n"
        "evict: pinned share -> unpinned LRU -> demote pinned\nlookup: RAM -> SSD (promoted) -> tail"
    )
    box(ax, 9.0, 4.35, 4.85, 1.9, "KVManager  (kv/manager.py)", manager, CACHE)
    arrow(ax, (8.0, 5.3), (9.0, 5.3))
    ax.text(8.05, 5.75, "lookup\ncache_block\nrelease", fontsize=7, va="center")
    arrow(ax, (10.65, 7.0), (10.65, 6.25), "pin, flush", offset=(0.08, 0.0))
    box(ax, 9.0, 2.4, 2.1, 1.45, "RAMStore", "full blocks, LRU\n7/8 of ram_max_bytes", CACHE, size=8.5)
    box(ax, 11.75, 2.4, 2.1, 1.45, "TailStore", "partial last blocks\n1/8 of ram_max_bytes", CACHE, size=8.5)
    arrow(ax, (10.0, 4.35), (10.0, 3.85))
    arrow(ax, (12.8, 4.35), (12.8, 3.85))
    arrow(ax, (11.42, 4.35), (11.42, 2.15), color="#6a3d9a")
    label = {"fontsize": 7, "color": "#6a3d9a", "rotation": 90, "ha": "center", "va": "center"}
    ax.text(11.42, 3.1, "next tier", **label, bbox={"fc": "white", "ec": "none", "pad": 1})

    # SSD
    store = (
        "<cache_dir>/<namespace>/<hh>/<hash>.safetensors\n+ tails/, index.json, pins.json, shutdown.json\n"
        "keyed blake3 checksum; temp + fsync + rename\ncorrupt, foreign, truncated -> miss + deleted\n"
        "disk budget, TTL, free-space floor"
    )
    box(ax, 0.3, 0.6, 4.6, 2.3, "SSDStore  (kv/ssd/store.py, kv/ssd/index.py)", store, DISK)
    writer = (
        '"ssd-writer", non-daemon, nice +10\nbounded queue, pending dedup\nheld while a request prefills\n'
        "queue closed, drained at shutdown"
    )
    box(ax, 5.3, 0.6, 3.3, 2.3, "SSDWriterThread", writer, DISK)
    tier = "write_through | evict_only\nreads on the worker thread, verified, promoted"
    box(ax, 9.0, 0.6, 4.85, 1.55, "SSDTier  (kv/ssd/tier.py)", tier, DISK)
    arrow(ax, (9.0, 1.5), (8.6, 1.5), color="#6a3d9a")
    arrow(ax, (5.3, 1.5), (4.9, 1.5), color="#6a3d9a")
    ax.text(4.93, 1.7, "save", fontsize=7, color="#6a3d9a")
    purple = {"arrowstyle": "-|>", "mutation_scale": 12, "color": "#6a3d9a", "lw": 1.2, "linestyle": "--"}
    ax.add_patch(FancyArrowPatch((10.2, 0.6), (2.6, 0.6), **purple, connectionstyle="bar,fraction=-0.04"))
    loads = "load_blocks: windows of 8 read ahead, verified, promoted"
    ax.text(6.4, 0.12, loads, fontsize=7, color="#6a3d9a", ha="center")

    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


# --- The packages, drawn from the code's imports ---------------------------------------------------------------

PACKAGE = ROOT / "mlx_kvserve"
# Where each box sits: (x, y, width, height) and its layer (0 = the leaves). An import from a box to one of a
# higher layer goes against the direction the layers promise; it is drawn red and printed.
BOXES = {
    "commands": ((0.3, 13.2, 6.4, 1.4), 6, "the command line (top-level modules)"),
    "launch": ((6.9, 13.2, 2.6, 1.4), 6, "launch/"),
    "service": ((9.7, 13.2, 2.6, 1.4), 6, "service/"),
    "cpu": ((12.5, 13.2, 3.2, 1.4), 6, "cpu/ (installed by the CLI)"),
    "server": ((0.3, 11.0, 10.2, 1.6), 5, "server/"),
    "router": ((10.9, 11.0, 4.8, 1.6), 5, "router/"),
    "registry": ((3.5, 9.4, 6.5, 1.1), 4, "registry/"),
    "engine": ((0.5, 6.8, 4.0, 1.9), 3, "engine/ (its front)"),
    "engine/batch": ((4.7, 6.8, 4.3, 1.9), 3, "engine/batch/"),
    "engine/speculative": ((9.2, 6.8, 3.1, 1.9), 3, "engine/speculative/"),
    "engine/memory": ((12.5, 6.8, 3.0, 1.9), 3, "engine/memory/"),
    "engine/request": ((0.5, 4.5, 2.6, 1.5), 2, "engine/request.py"),
    "engine/cache": ((3.5, 4.5, 6.2, 1.5), 2, "engine/cache/"),
    "engine/sampling": ((10.1, 4.5, 5.4, 1.5), 2, "engine/sampling/"),
    "kv": ((0.3, 1.9, 5.0, 1.9), 1, "kv/"),
    "kv/ssd": ((5.5, 1.9, 4.4, 1.9), 1, "kv/ssd/"),
    "models": ((10.1, 1.9, 2.2, 1.9), 1, "models/"),
    "vision": ((12.5, 1.9, 1.6, 1.9), 1, "vision/"),
    "formats": ((14.3, 1.9, 1.4, 1.9), 1, "formats/"),
    "leaves": ((0.3, 0.2, 15.4, 1.1), 0, "leaves (imported from everywhere: the arrows into them are left out)"),
}
SPLIT = ("engine", "kv", "server")  # a sub-package of these is a box of its own (server's stay in server/)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """Each module of mlx_kvserve/ -> the package's modules it imports, by any import statement (relative ones
    resolved; `from pkg import mod` counts `pkg.mod`)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        here = name.split(".")[: None if path.name == "__init__.py" else -1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + [node.module] if node.module else base)
                found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        graph[name] = found & set(paths)
    return graph


def box_of(module: str, graph: dict[str, set[str]]) -> str:
    parts = module.split(".")[1:] or ["__init__"]
    if parts[0] == "engine" and parts[1:2] == ["request"]:
        return "engine/request"
    if parts[0] in SPLIT and parts[0] != "server" and len(parts) > 1 and (PACKAGE / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}/{parts[1]}"
    if (PACKAGE / parts[0]).is_dir():
        return parts[0]
    # A module at the top: a leaf unless it reaches a package (then it is part of the command line).
    seen, todo = set(), [module]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    leaf = all(m.count(".") == 1 or m.startswith("mlx_kvserve.formats") for m in seen)
    return "leaves" if leaf else "commands"


def box_edges(graph: dict[str, set[str]]) -> tuple[dict[str, list[str]], Counter]:
    """The modules in each box, and the imports between boxes (counted by module pairs)."""
    members: dict[str, list[str]] = {}
    for module in sorted(graph):
        parts, box = module.split(".")[1:], box_of(module, graph)
        if not PACKAGE.joinpath(*parts).is_dir():  # a package's __init__ is named by its box
            folder = box.split("/") if (PACKAGE / box).is_dir() else parts[:-1]
            members.setdefault(box, []).append("/".join(parts[len(folder) :]))
    edges: Counter = Counter()
    for module, imported in graph.items():
        for other in imported:
            a, b = box_of(module, graph), box_of(other, graph)
            if a != b and b != "leaves":
                edges[(a, b)] += 1
    return members, edges


def problems(members: dict[str, list[str]], edges: Counter) -> list[str]:
    """What the picture cannot show as the layers promise: a box with no place in BOXES (a new package), an import
    from a box to one of a higher layer."""
    found = [f"no place in BOXES for {name}" for name in sorted(set(members) - set(BOXES))]
    for (a, b), count in sorted(edges.items()):
        if a in BOXES and b in BOXES and BOXES[a][1] < BOXES[b][1]:
            found.append(f"against the layers: {a} -> {b} ({count} imports)")
    return found


def draw_packages(out: Path) -> None:
    """Draw the boxes with their modules and the imports between them (those against the layers red, dashed)."""
    members, edges = box_edges(package_imports())
    fig, ax = plt.subplots(figsize=(16, 15))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 15.2)
    ax.axis("off")
    ax.text(0.1, 15.1, "mlx-kvserve: packages and their imports (drawn from the code)", fontsize=14, weight="bold")
    ax.add_patch(FancyBboxPatch((0.3, 4.3), 15.4, 4.7, boxstyle="round,pad=0.02", fc=BG, ec="#999", lw=0.8))
    ax.text(0.45, 8.85, "engine/: one model, its block-cache front and the one MLX thread", fontsize=8, style="italic")
    colors = {6: HTTP, 5: HTTP, 4: "#fff4d6", 3: WORKER, 2: WORKER, 1: CACHE, 0: "#ffffff"}
    for name, ((x, y, w, h), layer, title) in BOXES.items():
        stems = [s for s in members.get(name, []) if s != "__main__"]
        body = textwrap.fill(" · ".join(stems), width=int(w * 10.5))
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=colors[layer], ec="#444", lw=1.0))
        ax.text(x + 0.08, y + h - 0.08, title, fontsize=8.5, weight="bold", va="top")
        ax.text(x + 0.08, y + h - 0.36, body, fontsize=6.6, va="top", color="#333", linespacing=1.25)
    for (a, b), count in sorted(edges.items()):
        (ax_, ay, aw, ah), la, _ = BOXES[a]
        (bx, by, bw, bh), lb, _ = BOXES[b]
        # Spread the ends along each box's edge by where the other box lies, so the arrows fan out.
        start_x = ax_ + aw * (0.15 + 0.7 * (bx + bw / 2) / 16)
        end_x = bx + bw * (0.15 + 0.7 * (ax_ + aw / 2) / 16)
        if la > lb:
            start, end, color, style = (start_x, ay), (end_x, by + bh), "#555", "-"
        elif la == lb:
            left = ax_ < bx
            start = (ax_ + aw if left else ax_, ay + ah * 0.3)
            end = (bx if left else bx + bw, by + bh * 0.3)
            color, style = "#1f5fa8", "-"
        else:
            start, end, color, style = (start_x, ay + ah), (end_x, by), "#c62828", "--"
        looks = {"arrowstyle": "-|>", "mutation_scale": 9, "color": color, "linestyle": style, "alpha": 0.6}
        bend = f"arc3,rad={0.25 if la == lb else 0.0}"
        ax.add_patch(FancyArrowPatch(start, end, **looks, lw=0.5 + 0.2 * min(count, 8), connectionstyle=bend))
    key = "arrow: imports (width: module pairs); blue: within a layer; red dashed: against the layers"
    ax.text(15.7, 0.05, key, fontsize=7, ha="right", color="#555")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--check", action="store_true", help="only check the imports fit the picture (exit 1 if not)")
    args = parser.parse_args()
    members, edges = box_edges(package_imports())
    found = problems(members, edges)
    for line in found:
        print(line)
    if args.check:
        print(f"{len(members)} boxes, {len(edges)} imports between them, {len(found)} problems")
        raise SystemExit(1 if found else 0)
    if any(line.startswith("no place") for line in found):
        raise SystemExit("give the new package a place in BOXES first")
    use_matplotlib()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    draw_packages(args.out_dir / "packages.png")
    draw_request_path(args.out_dir / "architecture.png")


if __name__ == "__main__":
    main()
