// The router's page: each backend's figures from /health and the policy's choices from /metrics.
import { AuthError, api, el, forgetKey, getKey, num, parseMetrics, setKey, takeKeyFromUrl } from "./api.js";

const $ = (id) => document.getElementById(id);
let timer = null;

/** {"name{a="x",b="y"}": v} -> [{labels: {a: "x", b: "y"}, value: v}] for one metric name. */
function series(metrics, name) {
  return Object.entries(metrics).filter(([k]) => k.startsWith(`${name}{`)).map(([k, value]) => ({
    labels: Object.fromEntries([...k.matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]])), value }));
}

function byBackend(metrics, name) {
  return Object.fromEntries(series(metrics, name).map((s) => [s.labels.backend, s.value]));
}

function locked(message) {
  clearTimeout(timer);
  $("board").hidden = true;
  $("forget-key").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

async function poll() {
  try {
    const metricsResponse = await api("/metrics");
    const metrics = parseMetrics(await metricsResponse.text());
    const health = await (await api("/health")).json();
    $("login").hidden = true;
    $("board").hidden = false;
    $("forget-key").hidden = false;
    $("status").textContent = health.status;
    $("status").className = `badge ${health.status === "ok" ? "good" : "bad"}`;
    $("policy").textContent = `policy: ${health.policy}`;
    $("tokenizer").textContent = `tokenizer: ${health.tokenizer}`;
    const prompt = byBackend(metrics, "mlx_kvserve_router_prompt_tokens_total");
    const estimated = byBackend(metrics, "mlx_kvserve_router_estimated_cached_tokens_total");
    const reported = byBackend(metrics, "mlx_kvserve_router_reported_cached_tokens_total");
    $("backends").querySelector("tbody").replaceChildren(...health.backends.map((b) => el("tr", { "data-backend": b.url },
      el("td", { class: "hash" }, b.url), el("td", { class: b.up ? "" : "error" }, b.up ? "yes" : b.error || "no"),
      el("td", {}, num(b.requests)), el("td", {}, num(b.pending_prefill_tokens)), el("td", {}, num(b.decode_tokens)),
      el("td", {}, num(b.cached_blocks)), el("td", {}, num(prompt[b.url])),
      el("td", {}, `${num(estimated[b.url])} / ${num(reported[b.url])}`),
      el("td", {}, b.events.following ? `following (seq ${b.events.seq})` : "not following"),
      el("td", {}, el("a", { href: `${b.url}/ui`, target: "_blank", rel: "noopener noreferrer" }, "its page")))));
    const decisions = series(metrics, "mlx_kvserve_router_decisions_total").sort((a, b) => b.value - a.value);
    $("decisions").querySelector("tbody").replaceChildren(...decisions.map((d) => el("tr", {},
      el("td", {}, d.labels.policy), el("td", {}, d.labels.reason), el("td", { class: "hash" }, d.labels.backend),
      el("td", {}, num(d.value)))));
  } catch (err) {
    if (err instanceof AuthError) return locked(getKey() ? "That key was refused." : "");
    $("status").textContent = err.message;
    $("status").className = "badge bad";
  }
  timer = setTimeout(poll, 1000);
}

takeKeyFromUrl();
$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  setKey($("key-input").value.trim());
  $("key-input").value = "";
  $("login-error").textContent = "";
  poll();
});
$("forget-key").addEventListener("click", () => { forgetKey(); locked(); });
poll();
