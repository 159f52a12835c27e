// The requests tab: the server's log of recent completion requests, newest first, with what the cache
// did for each: the cached share of its prompt and the prefill time that saved.
import { el, ms, num, pct } from "./api.js";

/** A real hit: at least half the prompt came from the cache (a shared system prompt alone is not one). */
export const isHit = (r) => r.prompt_tokens > 0 && r.cached_tokens >= r.prompt_tokens / 2;

/** Seconds of prefill the cached tokens saved, at the server's measured prefill rate (tokens/s). */
export const savedSeconds = (r, prefillRate) => (prefillRate > 0 ? r.cached_tokens / prefillRate : null);

export function updateRequests(requests, prefillRate) {
  const rows = [...requests].reverse().map((r) => {
    const share = r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : null;
    const saved = savedSeconds(r, prefillRate);
    return el("tr", { class: r.status >= 400 ? "error" : isHit(r) ? "hit" : "", "data-saved-s": saved ?? "" },
      el("td", {}, new Date(r.finished_at * 1000).toLocaleTimeString()),
      el("td", { class: "hash" }, r.id),
      el("td", {}, r.endpoint + (r.stream ? " (stream)" : "")),
      el("td", {}, r.status),
      el("td", {}, num(r.prompt_tokens)),
      el("td", {}, num(r.cached_tokens)),
      el("td", {}, pct(share)),
      el("td", {}, saved == null ? "–" : `≈ ${ms(saved)}`),
      el("td", {}, num(r.completion_tokens)),
      el("td", {}, ms(r.ttft_s)),
      el("td", {}, ms(r.duration_s)),
      el("td", {}, r.error || ""));
  });
  document.querySelector("#requests-table tbody").replaceChildren(...rows);
}
