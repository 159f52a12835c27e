// The cache tab: bytes against budgets, blocks, hits by tier, the SSD writer, evictions, damaged files,
// the last startup's validation. Every figure reads one /health field (its data-field names it).
import { bytes, el, figure, num, pct } from "./api.js";

const bytesField = (c, key, label) => figure(`cache.${key}`, label, c[key], bytes(c[key]));
const countField = (c, key, label) => figure(`cache.${key}`, label, c[key], num(c[key]));

function group(title, ...figures) {
  return el("div", { class: "group" }, el("h3", {}, title), el("div", { class: "figures" }, ...figures.filter(Boolean)));
}

function setBar(id, used, budget) {
  const share = budget ? Math.min(1, used / budget) : 0;
  const bar = document.getElementById(id);
  bar.style.width = `${(100 * share).toFixed(1)}%`;
  bar.className = share > 0.9 ? "full" : "";
  document.getElementById(`${id}-text`).textContent =
    budget ? `${bytes(used)} of ${bytes(budget)} (${pct(used / budget)})` : `${bytes(used)} (no budget)`;
}

export function updateCache(health) {
  const c = health.cache || {};
  document.getElementById("health-raw").textContent = JSON.stringify(health, null, 1);
  if (!c.enabled) {
    document.getElementById("cache-groups").replaceChildren(el("p", { class: "muted" }, "The block cache is off."));
    return;
  }
  const ssd = "ssd_bytes" in c;
  setBar("bar-ram", c.kv_ram_bytes, c.kv_ram_max_bytes);
  setBar("bar-ssd", ssd ? c.ssd_bytes + (c.ssd_tail_bytes || 0) : 0, ssd ? c.ssd_max_bytes : 0);
  const ramHits = c.kv_hits - c.kv_promotions;
  const reused = c.kv_hits || 0;
  document.getElementById("cache-groups").replaceChildren(
    group("RAM",
      bytesField(c, "kv_ram_bytes", "blocks"),
      bytesField(c, "kv_ram_max_bytes", "budget for blocks"),
      countField(c, "kv_ram_blocks", "full blocks"),
      countField(c, "kv_tails", "tails / checkpoints"),
      bytesField(c, "kv_tail_bytes", "tail bytes"),
      countField(c, "kv_in_use_blocks", "in use by requests"),
      countField(c, "kv_pinned_blocks", "pinned"),
      bytesField(c, "kv_pinned_ram_bytes", "pinned bytes")),
    ssd && group("SSD",
      bytesField(c, "ssd_bytes", "blocks"),
      figure("cache.ssd_max_bytes", "budget", c.ssd_max_bytes, c.ssd_max_bytes ? bytes(c.ssd_max_bytes) : "unlimited"),
      countField(c, "ssd_blocks", "blocks on disk"),
      bytesField(c, "ssd_tail_bytes", "tail bytes"),
      figure("cache.ssd_role", "folder role", c.ssd_role, c.ssd_role),
      figure("cache.ssd_policy", "policy", c.ssd_policy, c.ssd_policy)),
    group("Hits",
      countField(c, "kv_lookups", "lookups"),
      countField(c, "kv_hits", "blocks reused"),
      figure("ram_hit_blocks", "blocks reused from RAM", ramHits, `${num(ramHits)} (${pct(reused ? ramHits / reused : null)})`),
      figure("ssd_hit_blocks", "blocks reused from SSD", c.kv_promotions, `${num(c.kv_promotions)} (${pct(reused ? c.kv_promotions / reused : null)})`),
      countField(c, "kv_misses", "lookups past RAM"),
      ssd && countField(c, "ssd_misses", "lookups past SSD"),
      countField(c, "kv_tail_hits", "tail hits"),
      countField(c, "kv_hit_tokens", "tokens from blocks"),
      countField(c, "kv_tail_hit_tokens", "tokens from tails")),
    ssd && group("SSD writer",
      countField(c, "writer_queue_depth", "queued blocks"),
      bytesField(c, "writer_queued_bytes", "queued bytes"),
      countField(c, "writer_written", "written"),
      figure("cache.writer_bandwidth_mib_s", "throughput", c.writer_bandwidth_mib_s, `${num(c.writer_bandwidth_mib_s, 1)} MiB/s`),
      countField(c, "writer_retries", "retries"),
      countField(c, "writer_failures", "gave up"),
      countField(c, "writer_shed", "shed"),
      countField(c, "ssd_errors", "write errors")),
    group("Evictions",
      countField(c, "kv_evictions", "RAM blocks"),
      ssd && countField(c, "ssd_evictions", "SSD blocks"),
      ssd && countField(c, "ssd_tail_evictions", "SSD tails"),
      ssd && countField(c, "ssd_pruned", "pruned (TTL)"),
      countField(c, "kv_pinned_demotions", "pinned, moved to SSD"),
      ssd && countField(c, "ssd_corrupt", "damaged blocks deleted")),
    ssd && group("Last startup",
      ...Object.entries(c.ssd_startup_validation || {}).map(([k, v]) =>
        figure(`cache.ssd_startup_validation.${k}`, k.replaceAll("_", " "), v, k === "elapsed_s" ? `${num(v, 3)} s` : num(v))),
      figure("cache.shutdown_clean", "previous shutdown", c.shutdown_clean,
        c.shutdown_clean == null ? "first start" : c.shutdown_clean ? "clean" : "not clean")),
  );
  const damaged = c.damaged_files || [];
  document.getElementById("damaged").replaceChildren(...(damaged.length
    ? damaged.map((d) => el("li", { class: "error" }, typeof d === "string" ? d : JSON.stringify(d)))
    : [el("li", { class: "muted" }, "none")]));
}
