// The overview: live figures from /health and /metrics, the prompts prefilling now, four small uPlot
// charts over the same five-minute window with readable clock labels, and TTFT against prompt length.
import { el, figure, ms, num, pct } from "./api.js";
import { isHit, savedSeconds } from "./requests.js";

const WINDOW = 300; // points kept per time chart (5 minutes at one poll a second)
const COLORS = ["#2b6cb0", "#c05621", "#2f855a", "#6b46c1"];

function chart(target, labels, { points = false, byTime = true } = {}) {
  const series = [{}];
  labels.forEach((label, i) => series.push({
    label,
    stroke: COLORS[i],
    width: points ? 0 : 1.5,
    spanGaps: !points,
    points: points ? { show: true, size: 7, fill: COLORS[i], stroke: COLORS[i] } : { show: false },
    paths: points ? () => null : undefined,
  }));
  const node = document.getElementById(target);
  const clock = (u, splits) => splits.map((v) => new Date(v * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }));
  const options = {
    width: node.clientWidth || 480,
    height: 180,
    series,
    legend: { live: false }, // labels only: values at the cursor read "--" until it hovers
    // Every time chart shows the last WINDOW seconds, whatever its points: their times line up. The
    // others (prompt tokens across) start at 0, so a lone point or equal lengths still have a width.
    scales: {
      x: byTime ? { time: true, range: () => [now() - WINDOW, now()] }
        : { time: false, range: (u, lo, hi) => [0, Math.max(1, 1.05 * hi)] },
    },
    axes: [byTime ? { values: clock, space: 70, incrs: [15, 30, 60, 120, 300] } : { space: 60 }, { size: 50 }],
  };
  return new uPlot(options, [[], ...labels.map(() => [])], node);
}

const now = () => Date.now() / 1000;

function prefillBars(prefilling) {
  // A long prompt's prefill as it runs (/health batch.prefilling): uncached tokens done of those to do.
  return prefilling.map((p, i) => {
    const share = p.done / Math.max(1, p.total);
    const fill = el("div");
    fill.style.width = `${(100 * share).toFixed(1)}%`; // CSSOM: the page's CSP refuses style attributes
    return el("div", { class: "bar-row", "data-field": `batch.prefilling.${i}`, "data-value": p.done },
      el("span", {}, "prefilling"), el("div", { class: "bar" }, fill),
      el("span", {}, `${num(p.done)} of ${num(p.total)} uncached tokens (${pct(share)})`));
  });
}

const median = (xs) => {
  if (!xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
};

export class LivePanel {
  constructor() {
    this.charts = null;
    this.series = { t: [], inFlight: [], running: [], waiting: [], batch: [], prompt: [], decode: [], share: [] };
    this.last = null; // the previous poll: {t, prefill, decode}
  }

  makeCharts() {
    // Made when the overview is first visible: uPlot needs the container's width.
    this.charts = {
      requests: chart("chart-requests", ["in flight", "running", "waiting", "batch size"]),
      tps: chart("chart-tps", ["prompt", "decode"]),
      ttft: chart("chart-ttft", ["cold", "cache hit (≥ half cached)"], { points: true }),
      share: chart("chart-share", ["cached share"]),
      ttftLength: chart("chart-ttft-length", ["cold", "cache hit (≥ half cached)"], { points: true, byTime: false }),
    };
    window.addEventListener("resize", () => this.resize());
  }

  resize() {
    for (const plot of Object.values(this.charts || {})) {
      plot.setSize({ width: plot.root.parentElement.clientWidth, height: 180 });
    }
  }

  update({ health, metrics, requests }) {
    const batch = health.batch || {};
    const t = Date.now() / 1000;
    const inFlight = metrics?.["mlx_kvserve_requests_in_flight"] ?? null;
    const promptTotal = metrics?.["mlx_kvserve_prompt_tokens_total"] ?? 0;
    const cachedTotal = metrics?.["mlx_kvserve_cached_prompt_tokens_total"] ?? 0;
    const share = promptTotal ? cachedTotal / promptTotal : null;
    let promptRate = null, decodeRate = null;
    if (this.last && t > this.last.t) {
      promptRate = (batch.prefill_tokens - this.last.prefill) / (t - this.last.t);
      decodeRate = (batch.decode_tokens - this.last.decode) / (t - this.last.t);
    }
    this.last = { t, prefill: batch.prefill_tokens, decode: batch.decode_tokens };
    const done = (requests || []).filter((r) => r.ttft_s != null);
    const cold = done.filter((r) => !isHit(r)).map((r) => r.ttft_s);
    const hit = done.filter(isHit).map((r) => r.ttft_s);
    const rate = batch.prefill_tokens_per_s;
    const saved = (requests || []).reduce((sum, r) => sum + (savedSeconds(r, rate) || 0), 0);

    document.getElementById("live-figures").replaceChildren(
      figure("requests_in_flight", "in flight", inFlight),
      figure("batch.running", "running", batch.running),
      figure("batch.waiting", "waiting", batch.waiting),
      figure("batch.batch_size", "batch size", batch.batch_size, `${num(batch.batch_size)} / ${num(batch.max_batch)}`),
      figure("prompt_tokens_per_s", "prompt tok/s now", promptRate, num(promptRate)),
      figure("decode_tokens_per_s", "decode tok/s now", decodeRate, num(decodeRate)),
      figure("batch.prefill_tokens_per_s", "prefill tok/s (busy)", batch.prefill_tokens_per_s, num(batch.prefill_tokens_per_s)),
      figure("batch.decode_tokens_per_s", "decode tok/s (busy)", batch.decode_tokens_per_s, num(batch.decode_tokens_per_s)),
      figure("cached_share", "cached prompt tokens", share, pct(share)),
      figure("ttft_cold_median", "TTFT cold (median)", median(cold), ms(median(cold))),
      figure("ttft_hit_median", "TTFT hit (median)", median(hit), ms(median(hit))),
      figure("prefill_saved_s", "prefill time saved (listed requests)", saved, !rate ? "–" : saved < 1 ? ms(saved) : `${num(saved, 1)} s`),
    );
    document.getElementById("prefilling").replaceChildren(...prefillBars(batch.prefilling || []));
    this.showProblems(health);
    if (!this.charts) return;
    const s = this.series;
    const push = (name, v) => { s[name].push(v); if (s[name].length > WINDOW) s[name].shift(); };
    push("t", t); push("inFlight", inFlight); push("running", batch.running); push("waiting", batch.waiting);
    push("batch", batch.batch_size); push("prompt", promptRate); push("decode", decodeRate);
    push("share", share == null ? null : 100 * share);
    this.charts.requests.setData([s.t, s.inFlight, s.running, s.waiting, s.batch]);
    this.charts.tps.setData([s.t, s.prompt, s.decode]);
    this.charts.share.setData([s.t, s.share]);
    const sorted = [...done].sort((a, b) => a.finished_at - b.finished_at);
    this.charts.ttft.setData([
      sorted.map((r) => r.finished_at),
      sorted.map((r) => (isHit(r) ? null : r.ttft_s)),
      sorted.map((r) => (isHit(r) ? r.ttft_s : null)),
    ]);
    this.showTtftByLength(done);
  }

  showTtftByLength(done) {
    // What the cache changes: TTFT grows with the prompt's uncached tokens, so cold points climb with
    // length while hits stay low. uPlot wants x ascending; the counts are there for the page's tests.
    const byLength = [...done].sort((a, b) => a.prompt_tokens - b.prompt_tokens);
    this.charts.ttftLength.setData([
      byLength.map((r) => r.prompt_tokens),
      byLength.map((r) => (isHit(r) ? null : r.ttft_s)),
      byLength.map((r) => (isHit(r) ? r.ttft_s : null)),
    ]);
    const node = document.getElementById("chart-ttft-length");
    node.setAttribute("data-cold", byLength.filter((r) => !isHit(r)).length);
    node.setAttribute("data-hit", byLength.filter(isHit).length);
    node.setAttribute("data-prompt-tokens", byLength.map((r) => r.prompt_tokens).join(","));
  }

  showProblems(health) {
    const problems = health.problems || [];
    document.getElementById("problems").replaceChildren(
      ...(problems.length ? problems.map((p) => el("li", { class: "error" }, p)) : [el("li", { class: "muted" }, "none")]));
  }

  showModels(models, health) {
    // A multi-model server reports each model's state and memory ([[models]], docs/models.md);
    // a one-model server reports neither: its one model is the loaded one /health describes.
    const rows = (models || []).map((m) => el("tr", {},
      el("td", {}, m.id),
      el("td", {}, m.state ? "" : num(health?.context_length)),
      el("td", {}, m.state || "loaded"),
      el("td", {}, m.memory_bytes ? `${(m.memory_bytes / 2 ** 30).toFixed(2)} GiB` : "")));
    document.querySelector("#models tbody").replaceChildren(...rows);
    // The memory plan at start (engine/memory/plan.py): what the KV may take beside the weights.
    document.getElementById("memory-plan").textContent = health?.memory_plan?.line || "";
  }
}
