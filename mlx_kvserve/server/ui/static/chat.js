// The playground: a streamed chat through /v1/chat/completions, reasoning shown apart, and per turn the
// cached prompt tokens (usage.prompt_tokens_details.cached_tokens) and the time to the first token.
// While a reply streams, Send is disabled and Stop aborts it (the server stops generating when the
// client leaves); the partial reply stays in the log and in the history.
import { api, el, ms, num } from "./api.js";

/** The `data:` payloads of a server-sent event stream, parsed as JSON, as they arrive. */
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

export class ChatPanel {
  constructor(onError) {
    this.onError = onError;
    this.history = [];
    this.busy = false;
    this.abort = null; // the AbortController of the reply streaming now
    document.getElementById("chat-stop").addEventListener("click", () => this.abort?.abort());
    document.getElementById("chat-form").addEventListener("submit", (ev) => { ev.preventDefault(); this.send(); });
    document.getElementById("chat-input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); this.send(); }
    });
    document.getElementById("chat-new").addEventListener("click", () => {
      this.history = [];
      document.getElementById("chat-log").replaceChildren();
    });
  }

  showModels(models) {
    const select = document.getElementById("chat-model");
    const chosen = select.value;
    select.replaceChildren(...models.map((m) => el("option", { value: m.id, selected: m.id === chosen }, m.id)));
  }

  async send() {
    const input = document.getElementById("chat-input");
    const text = input.value.trim();
    if (!text || this.busy) return;
    this.setBusy(true);
    input.value = "";
    const system = document.getElementById("chat-system").value.trim();
    this.history.push({ role: "user", content: text });
    const log = document.getElementById("chat-log");
    log.append(el("div", { class: "turn user" }, text));
    const reasoning = el("pre", { class: "reasoning" });
    const details = el("details", { class: "reasoning-box", hidden: true }, el("summary", {}, "reasoning"), reasoning);
    const content = el("div", { class: "content" });
    const meta = el("div", { class: "turn-meta muted" }, "waiting for the first token (prefilling the prompt)…");
    const turn = el("div", { class: "turn assistant" }, details, content, meta);
    log.append(turn);
    const started = performance.now();
    let ttft = null, usage = null, reply = "", pieces = 0;
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST",
        signal: this.abort.signal,
        json: {
          model: document.getElementById("chat-model").value || undefined,
          messages: [...(system ? [{ role: "system", content: system }] : []), ...this.history],
          max_tokens: Number(document.getElementById("chat-max").value) || 256,
          temperature: Number(document.getElementById("chat-temp").value),
          stream: true,
          stream_options: { include_usage: true },
        },
      });
      if (!response.ok) {
        const body = await response.json().catch(() => null);
        throw new Error(body?.error?.message || `HTTP ${response.status}`);
      }
      for await (const chunk of sseData(response)) {
        if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices?.[0]?.delta || {};
        if ((delta.content || delta.reasoning_content) && ttft === null) ttft = (performance.now() - started) / 1000;
        if (delta.reasoning_content) { details.hidden = false; reasoning.textContent += delta.reasoning_content; }
        if (delta.content) { reply += delta.content; content.textContent = reply; }
        if (delta.content || delta.reasoning_content) {
          pieces += 1;
          meta.textContent = `streaming… ${pieces} pieces · first token after ${ms(ttft)}`;
        }
        log.scrollTop = log.scrollHeight;
      }
      this.history.push({ role: "assistant", content: reply });
      this.showMeta(meta, usage, ttft);
    } catch (err) {
      if (err.name === "AbortError") { // stopped: what came so far stays
        if (reply) this.history.push({ role: "assistant", content: reply });
        else this.history.pop();
        meta.textContent = `stopped after ${pieces} pieces · first token after ${ms(ttft)}`;
        meta.dataset.stopped = "true";
      } else {
        this.history.pop();
        meta.textContent = `failed: ${err.message}`;
        meta.className = "turn-meta error";
        this.onError(err);
      }
    } finally {
      this.setBusy(false);
    }
  }

  setBusy(busy) {
    this.busy = busy;
    this.abort = busy ? new AbortController() : null;
    document.getElementById("chat-send").disabled = busy;
    document.getElementById("chat-send").textContent = busy ? "Replying…" : "Send";
    document.getElementById("chat-stop").hidden = !busy;
  }

  showMeta(meta, usage, ttft) {
    const cached = usage?.prompt_tokens_details?.cached_tokens ?? 0;
    meta.dataset.cached = cached;
    meta.dataset.promptTokens = usage?.prompt_tokens ?? "";
    meta.dataset.ttft = ttft ?? "";
    const share = usage?.prompt_tokens ? ` (${Math.round((100 * cached) / usage.prompt_tokens)} %)` : "";
    meta.textContent = `prompt ${num(usage?.prompt_tokens)} tokens, ${num(cached)} from the cache${share} · `
      + `first token after ${ms(ttft)} · ${num(usage?.completion_tokens)} tokens generated`;
  }
}
