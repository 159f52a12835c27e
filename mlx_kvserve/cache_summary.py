"""`mlx-kvserve cache stats` in a few lines a person reads: how much of the prompts the cache served
(block and tail hits together), RAM and SSD used of their budgets in GiB, blocks, pins and the SSD
writer. A pure function of the server's JSON: `--json` prints the raw counters instead."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def gib(num_bytes: int | float) -> str:
    """GiB with two decimals; MiB below a hundredth of a GiB, which would read 0.00 GiB."""
    if 0 < num_bytes < GIB / 100:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / GIB:.2f} GiB"


def _of_budget(used: int, budget: int) -> str:
    return f"{gib(used)} of {gib(budget)}" if budget else f"{gib(used)} (no budget)"


def hit_line(stats: dict[str, Any], prefill_tokens: int | None) -> str:
    """Cached prompt tokens (whole blocks and partial tails), as a share of all prompt tokens when the
    tokens prefilled are known (the server's /health batch figures)."""
    blocks, tails = int(stats.get("kv_hit_tokens", 0)), int(stats.get("kv_tail_hit_tokens", 0))
    cached = blocks + tails
    parts = f"{blocks:,} in blocks, {tails:,} in tails"
    if prefill_tokens is None:
        return f"cache hits: {cached:,} prompt tokens served from the cache ({parts})"
    total = cached + prefill_tokens
    share = f"{100 * cached / total:.0f}%" if total else "-"
    return f"cache hits: {share} of prompt tokens ({cached:,} of {total:,}: {parts}); {prefill_tokens:,} prefilled"


def summary_lines(stats: dict[str, Any], prefill_tokens: int | None = None) -> list[str]:
    """The human summary of one model's /v1/cache/stats."""
    if not stats.get("enabled", True):
        return [f"cache: off ({stats.get('reason', 'disabled')})"]
    lines = [hit_line(stats, prefill_tokens)]
    lines.append(
        f"RAM: {_of_budget(stats.get('kv_ram_bytes', 0), stats.get('kv_ram_max_bytes', 0))}, "
        f"{stats.get('kv_ram_blocks', 0):,} blocks ({stats.get('kv_in_use_blocks', 0):,} in use), "
        f"{stats.get('kv_tails', 0):,} tails, {stats.get('kv_evictions', 0):,} evicted"
    )
    if "ssd_blocks" in stats:
        lines.append(
            f"SSD: {_of_budget(stats.get('ssd_bytes', 0) + stats.get('ssd_tail_bytes', 0), stats.get('ssd_max_bytes', 0))}, "
            f"{stats['ssd_blocks']:,} blocks, {stats.get('ssd_hits', 0):,} read back "
            f"({stats.get('ssd_policy', '?')}, {stats.get('ssd_role', 'owner')})"
        )
    else:
        lines.append("SSD: off")
    lines.append(
        f"pins: {stats.get('kv_pinned_blocks', 0):,} blocks pinned "
        f"({gib(stats.get('kv_pinned_ram_bytes', 0))} of them in RAM)"
    )
    if "writer_written" in stats:
        lines.append(
            f"writer: {stats['writer_written']:,} written, {stats.get('writer_queue_depth', 0):,} queued, "
            f"{stats.get('writer_failures', 0):,} failed, {stats.get('writer_shed', 0):,} shed, "
            f"{stats.get('writer_bandwidth_mib_s', 0.0)} MiB/s"
        )
    damaged = stats.get("damaged_files") or []
    if damaged:
        lines.append(f"damaged files set aside: {len(damaged)} (see --json)")
    return lines


def summary(stats: dict[str, Any], health: dict[str, Any] | None = None) -> str:
    """Every model's summary: one block, or one per loaded model (a server with [[models]])."""
    prefill = ((health or {}).get("batch") or {}).get("prefill_tokens")
    models = stats.get("models")
    if not models:
        return "\n".join(summary_lines(stats, prefill))
    model_health = {m.get("name") or m.get("id"): m for m in (health or {}).get("models") or [] if isinstance(m, dict)}
    blocks = []
    for name, model_stats in models.items():
        model_prefill = ((model_health.get(name) or {}).get("batch") or {}).get("prefill_tokens")
        blocks.append("\n".join([f"[{name}]", *("  " + line for line in summary_lines(model_stats, model_prefill))]))
    return "\n".join(blocks) if blocks else "no model loaded"
