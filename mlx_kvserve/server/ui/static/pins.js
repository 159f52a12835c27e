// The pins tab: pins and cache_control leases, pin / unpin a pasted prompt, flush and prune with a
// confirmation. The server lists pins by block hash only; the first words of prompts pinned from this tab
// are remembered in this tab's session storage to label their blocks.
import { apiJson, el, num } from "./api.js";

const LABELS = "mlx-kvserve.pin-labels";
const labels = () => JSON.parse(sessionStorage.getItem(LABELS) || "{}");

function remember(hashes, text) {
  const all = labels();
  const words = text.trim().split(/\s+/).slice(0, 8).join(" ");
  for (const h of hashes) all[h] = words;
  sessionStorage.setItem(LABELS, JSON.stringify(all));
}

function pinBody(text, as) {
  return as === "prompt"
    ? { prompt: text }
    : { messages: [{ role: "system", content: text }], add_generation_prompt: false };
}

const ACTIONS = {
  flush: ["Drop every unpinned block from RAM?", () => apiJson("/v1/cache/flush", { method: "POST", json: {} })],
  "flush-ssd": ["Drop every unpinned block from RAM and from the SSD?",
    () => apiJson("/v1/cache/flush", { method: "POST", json: { ssd: true } })],
  prune: ["Delete SSD blocks past their TTL now?", () => apiJson("/v1/cache/prune", { method: "POST", json: {} })],
};

export class PinsPanel {
  constructor(onError) {
    this.onError = onError;
    this.pending = null; // the action waiting for its confirmation
    const result = document.getElementById("pin-result");
    document.getElementById("pin-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.pinText("pin").then((r) => {
        if (r) result.textContent = `pinned ${num(r.tokens)} tokens (${r.block_hashes.length} blocks)`;
      });
    });
    document.getElementById("unpin-text-button").addEventListener("click", () => {
      this.pinText("unpin").then((r) => {
        if (r) result.textContent = r.unpinned_count ? "unpinned" : "that prompt was not pinned";
      });
    });
    for (const button of document.querySelectorAll("#pins [data-action]")) {
      button.addEventListener("click", () => this.ask(button.dataset.action));
    }
    document.getElementById("confirm-yes").addEventListener("click", () => this.confirmed());
    document.getElementById("confirm-no").addEventListener("click", () => this.ask(null));
  }

  showLists(shown) {
    for (const id of ["pins-table", "leases-table"]) document.getElementById(id).hidden = !shown;
    document.getElementById("pins-own").hidden = shown;
  }

  /** POST the pasted prompt to /v1/cache/pin or unpin: the reply's body, or null (the error is shown). */
  async pinText(what) {
    const text = document.getElementById("pin-text").value;
    const as = document.getElementById("pin-as").value;
    const result = document.getElementById("pin-result");
    result.textContent = what === "pin" ? "pinning (a prompt not cached yet is prefilled first)…" : "unpinning…";
    try {
      const body = await apiJson(`/v1/cache/${what}`, { method: "POST", json: pinBody(text, as) });
      if (what === "pin") remember(body.block_hashes, text);
      await this.refresh();
      return body;
    } catch (err) {
      result.textContent = "";
      this.onError(err);
      return null;
    }
  }

  ask(action) {
    this.pending = action;
    document.getElementById("confirm").hidden = !action;
    if (action) document.getElementById("confirm-text").textContent = ACTIONS[action][0];
  }

  async confirmed() {
    const action = this.pending;
    this.ask(null);
    try {
      const out = await ACTIONS[action][1]();
      document.getElementById("admin-result").textContent = `${action}: ${JSON.stringify(out)}`;
      await this.refresh();
    } catch (err) {
      this.onError(err);
    }
  }

  async unpin(hash) {
    try {
      await apiJson("/v1/cache/unpin", { method: "POST", json: { block_hashes: [hash] } });
      await this.refresh();
    } catch (err) {
      this.onError(err);
    }
  }

  async refresh() {
    let listed;
    try {
      listed = await apiJson("/v1/cache/pins");
    } catch (err) {
      if (err.code !== "admin_key_required") throw err;
      // Several keys caching apart and no admin key: the list holds every key's blocks, not this key's to
      // see; pinning and unpinning this key's own prompts above still work.
      this.showLists(false);
      return;
    }
    this.showLists(true);
    const { pins, leases } = listed;
    const known = labels();
    const mark = (b) => (b ? "yes" : "–");
    document.querySelector("#pins-table tbody").replaceChildren(...pins.map((p) => el("tr", { "data-hash": p.block_hash },
      el("td", { class: "hash", title: p.block_hash }, p.block_hash.slice(0, 16)),
      el("td", {}, p.pin_count), el("td", {}, mark(p.in_ram)), el("td", {}, mark(p.on_ssd)),
      el("td", { class: "muted" }, known[p.block_hash] || ""),
      el("td", {}, el("button", { type: "button", class: "quiet", title: "one pin less on this block and its ancestors",
        onclick: () => this.unpin(p.block_hash) }, "Unpin")))));
    document.querySelector("#leases-table tbody").replaceChildren(...leases.map((l) => el("tr", {},
      el("td", { class: "hash", title: l.block_hash }, l.block_hash.slice(0, 16)),
      el("td", {}, l.blocks), el("td", {}, `${num(l.ttl_s)} s`), el("td", {}, `${num(l.expires_in_s)} s`))));
  }
}
