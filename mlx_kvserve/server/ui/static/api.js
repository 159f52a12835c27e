// The server's API as the page uses it: the key (session storage only, never a cookie) and fetch.
const STORE = "mlx-kvserve.key";

export class AuthError extends Error {}

/** Take a key given once as /ui?key=... into session storage, and drop it from the address bar. */
export function takeKeyFromUrl() {
  const url = new URL(window.location.href);
  if (!url.searchParams.has("key")) return;
  const key = url.searchParams.get("key");
  if (key) sessionStorage.setItem(STORE, key);
  url.searchParams.delete("key");
  history.replaceState(null, "", url.pathname + url.search + url.hash);
}

export const getKey = () => sessionStorage.getItem(STORE) || "";
export const setKey = (key) => sessionStorage.setItem(STORE, key);
export const forgetKey = () => sessionStorage.removeItem(STORE);

/** fetch() with the key; `json` is sent as the body. Throws AuthError on 401. */
export async function api(path, { method = "GET", json, signal } = {}) {
  const headers = {};
  const key = getKey();
  if (key) headers.authorization = `Bearer ${key}`;
  let body;
  if (json !== undefined) {
    headers["content-type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal, credentials: "omit", cache: "no-store" });
  if (response.status === 401) throw new AuthError("the server wants the admin key");
  return response;
}

/** The JSON body of a successful request; throws an Error with the server's message otherwise. */
export async function apiJson(path, options) {
  const response = await api(path, options);
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new Error(body?.error?.message || `${path}: HTTP ${response.status}`);
    error.code = body?.error?.code; // e.g. "admin_key_required": a panel may say so instead of failing
    throw error;
  }
  return body;
}

/** Prometheus text format -> {"name{labels}": value}. */
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const cut = line.lastIndexOf(" ");
    out[line.slice(0, cut)] = Number(line.slice(cut + 1));
  }
  return out;
}

// Formatting, shared by the panels.
export function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}
export const num = (n, digits = 0) => (n == null || Number.isNaN(n) ? "–" : Number(n).toLocaleString("en", { maximumFractionDigits: digits }));
export const pct = (x) => (x == null || Number.isNaN(x) ? "–" : `${(100 * x).toFixed(1)} %`);
export const ms = (s) => (s == null ? "–" : `${Math.round(s * 1000)} ms`);

/** A new element: el("td", {class: "x"}, "text", child, ...). Text is always set as text, never HTML. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

/** A figure: label, formatted value, and the raw value in data-value (what the tests compare). */
export function figure(field, label, value, text) {
  return el("div", { class: "figure", "data-field": field, "data-value": value ?? "" },
    el("span", { class: "label" }, label), el("span", { class: "value" }, text ?? num(value, 1)));
}
