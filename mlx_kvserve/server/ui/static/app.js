// The page: ask for the key when the server wants one, then poll /health, /metrics and the requests log
// once a second and hand them to the tabs.
import { AuthError, api, apiJson, forgetKey, parseMetrics, setKey, takeKeyFromUrl } from "./api.js";
import { updateCache } from "./cache.js";
import { ChatPanel } from "./chat.js";
import { LivePanel } from "./live.js";
import { PinsPanel } from "./pins.js";
import { updateRequests } from "./requests.js";

const POLL_MS = 1000;
const TABS = ["overview", "cache", "pins", "requests", "playground"];
const $ = (id) => document.getElementById(id);

const live = new LivePanel();
const showError = (err) => {
  if (err instanceof AuthError) return locked(err.message);
  const status = $("status");
  status.textContent = err.message;
  status.className = "badge bad";
};
const pins = new PinsPanel(showError);
const chat = new ChatPanel(showError);
let timer = null;
let models = [];

function locked(message) {
  clearTimeout(timer);
  timer = null;
  for (const id of TABS) $(id).hidden = true;
  $("tabs").hidden = true;
  $("forget-key").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("status").textContent = "locked";
  $("status").className = "badge";
}

function showTab() {
  const name = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "overview";
  for (const id of TABS) $(id).hidden = id !== name;
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.hash === `#${name}`);
  if (name === "overview" && !live.charts) live.makeCharts();
  if (name === "overview") live.resize();
  if (name === "pins") pins.refresh().catch(showError);
}

async function poll() {
  try {
    const [health, metricsText, log] = await Promise.all([
      api("/health").then((r) => r.json()),
      api("/metrics").then((r) => (r.ok ? r.text() : "")),
      apiJson("/v1/cache/requests"),
    ]);
    const metrics = parseMetrics(metricsText);
    const status = $("status");
    status.textContent = health.status;
    status.className = `badge ${health.status === "ok" ? "good" : "bad"}`;
    $("model").textContent = health.model;
    $("uptime").textContent = `up ${Math.round(health.uptime_s)} s`;
    live.update({ health, metrics, requests: log.requests });
    live.showModels(models, health);
    updateCache(health);
    updateRequests(log.requests, health.batch?.prefill_tokens_per_s);
    document.body.dataset.polled = String(Number(document.body.dataset.polled || 0) + 1);
  } catch (err) {
    showError(err);
    if (err instanceof AuthError) return;
  }
  timer = setTimeout(poll, POLL_MS);
}

async function open() {
  try {
    await apiJson("/v1/cache/requests"); // the admin check: 401 without the key the server wants
    models = (await apiJson("/v1/models")).data;
  } catch (err) {
    return err instanceof AuthError ? locked() : showError(err);
  }
  $("login").hidden = true;
  $("tabs").hidden = false;
  $("forget-key").hidden = false;
  chat.showModels(models);
  showTab();
  clearTimeout(timer);
  poll();
}

takeKeyFromUrl();
window.addEventListener("hashchange", showTab);
$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  setKey($("key-input").value.trim());
  $("key-input").value = "";
  await open();
  if (!$("login").hidden) $("login-error").textContent = "That key was refused.";
});
$("forget-key").addEventListener("click", () => { forgetKey(); locked(); });
setInterval(() => { if (!$("pins").hidden && timer) pins.refresh().catch(showError); }, 5 * POLL_MS);
open();
