// The requests tab: the server's log of recent completion requests, newest first.
import { el, ms, num } from "./api.js";

export function updateRequests(requests) {
  const rows = [...requests].reverse().map((r) => el("tr", { class: r.status >= 400 ? "error" : "" },
    el("td", {}, new Date(r.finished_at * 1000).toLocaleTimeString()),
    el("td", { class: "hash" }, r.id),
    el("td", {}, r.endpoint + (r.stream ? " (stream)" : "")),
    el("td", {}, r.status),
    el("td", {}, num(r.prompt_tokens)),
    el("td", {}, num(r.cached_tokens)),
    el("td", {}, num(r.completion_tokens)),
    el("td", {}, ms(r.ttft_s)),
    el("td", {}, ms(r.duration_s)),
    el("td", {}, r.error || "")));
  document.querySelector("#requests-table tbody").replaceChildren(...rows);
}
