"""Hybrid and sliding-window models, mlx-kvserve vs mlx_lm.server on the same model, in one run (issue 12).

Two random-weight models (float32, byte tokenizer, ChatML template) at a size this CPU prefills in seconds:
a hybrid (qwen3_5: Gated DeltaNet layers with full attention every 4th layer) and a sliding-window model
(gemma3_text: 10 of 12 layers see a 256-token window). Scenarios, each on both servers, greedy, short replies,
each on its own ~1.5k-token system prompt (so its first request is cold):
- repeat: the same chat twice;
- new question: a second question on the same system prompt;
- N-turn conversation: each turn appends the previous reply and a new user message;
- interleaved: 12 conversations on 12 system prompts, 3 turns each, round robin, one request at a time;
- restart: both servers restarted (ours on the same cache folder), then interleaved conversation 0 goes
  on with one more turn (its cold baseline: the same conversation under a fresh system prompt, next).
Per scenario: the tokens each server reports cached (usage.prompt_tokens_details.cached_tokens) against the
prefix the prompt shares with earlier requests, and the mean TTFT of the hits next to the cold requests'.
Checkpoint bytes: what one checkpoint of each model holds (measured on a real capture) and /health's figures.

    python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_families.py [--quick] [--out DIR]

Targets (issue 12): cached tokens >= 90% of the shared prefix in every scenario; hit TTFT >= 5x below cold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from bench import OURS, start_servers, stop_servers
from bench_common import ROOT, write_report
from bench_prefix import Server, stream_chat

from mlx_kvserve.config import CacheConfig
from mlx_kvserve.kv.tails import common_prefix
from mlx_kvserve.models.synthetic import family_config, random_model, write_model_folder

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5 (hybrid)": (
        "qwen3_5",
        {
            "hidden_size": 256,
            "num_hidden_layers": 8,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "full_attention_interval": 4,
            "linear_num_value_heads": 8,
            "linear_num_key_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        },
    ),
    "gemma3_text (sliding window)": (
        "gemma3_text",
        {
            "hidden_size": 256,
            "num_hidden_layers": 12,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 256,
            "sliding_window_pattern": 6,
        },
    ),
}
TARGET_SHARE, TARGET_SPEEDUP = 0.9, 5.0


class Params(NamedTuple):
    system_tokens: int  # about this many tokens per system prompt
    turns: int  # of the conversation scenario
    conversations: int  # of the interleaved scenario (3 turns each)
    max_tokens: int  # per reply


FULL = Params(system_tokens=1500, turns=6, conversations=12, max_tokens=16)
QUICK = Params(system_tokens=400, turns=3, conversations=4, max_tokens=8)


class Hit(NamedTuple):
    """One request expected to hit: its TTFT, the tokens the server says it took from its cache
    (None when the server does not report them) and the prompt tokens earlier requests shared."""

    ttft_s: float
    cached: int | None
    shared: int


def system_text(tag: str, num_tokens: int) -> str:
    """A system prompt of about `num_tokens` byte-tokenizer tokens (one per character but for a few
    merges); `tag` makes it unique, so that its first request is cold on both servers."""
    parts, i = [f"Session {tag}. You answer questions about rivers."], 0
    while sum(len(p) + 1 for p in parts) < num_tokens:
        parts.append(f"Rule {i}: river {i} flows to town {i * 7} in its valley.")
        i += 1
    return " ".join(parts)


def build(name: str) -> Path:
    """The model folder of SHAPES[name], written once (the folder name carries the shape)."""
    family, shape = SHAPES[name]
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    folder = ROOT / "results" / "models" / f"bench-{family}-{digest}"
    if not (folder / "model.safetensors").exists():
        config = family_config(family, **shape)
        write_model_folder(folder, config, random_model(config, scale=1.0))
    return folder


class Client:
    """Streamed greedy chats against one server. Keeps the token sequences it has sent and seen
    come back (each prompt, and each prompt with its reply as the next turn renders it), so that a
    request's shared prefix is its longest common token prefix with any of them."""

    def __init__(self, server: Server, tokenizer: Any, max_tokens: int):
        self.server, self.tokenizer, self.max_tokens = server, tokenizer, max_tokens
        self.seen: list[list[int]] = []

    def count(self, messages: list[dict], generation_prompt: bool = False) -> int:
        return len(self.tokens(messages, generation_prompt))

    def tokens(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt))

    def ask(self, messages: list[dict]) -> tuple[Hit, str]:
        """One request; its Hit's shared prefix is at most len(prompt) - 1 (what a lookup may use)."""
        prompt = self.tokens(messages, True)
        shared = max((common_prefix(prompt, s) for s in self.seen), default=0)
        reply = stream_chat(self.server, messages, self.max_tokens)
        self.seen += [prompt, self.tokens([*messages, {"role": "assistant", "content": reply.text}], False)]
        return Hit(reply.ttft_s, reply.cached_tokens, min(shared, len(prompt) - 1)), reply.text

    def turn(self, history: list[dict], question: str) -> Hit:
        """Append `question` to the history, ask, append the reply."""
        history.append({"role": "user", "content": question})
        hit, text = self.ask(history)
        history.append({"role": "assistant", "content": text})
        return hit


def scenarios(client: Client, p: Params, nonce: str) -> tuple[dict, dict | None]:
    """Every scenario on one server, in order, each on fresh system prompts; the restart comes last.
    Returns ({scenario: {"cold_s": [...], "hits": [Hit, ...]}}, our /health "cache" object taken just
    before the restart, or None for mlx_lm.server)."""
    out: dict = {}

    def system(tag: str) -> dict:
        return {"role": "system", "content": system_text(f"{nonce}-{tag}", p.system_tokens)}

    chat = [system("repeat"), {"role": "user", "content": "Which town is on river 3?"}]
    cold, _ = client.ask(chat)
    out["repeat"] = {"cold_s": [cold.ttft_s], "hits": [client.ask(chat)[0]]}

    sys_msg = system("question")
    cold, _ = client.ask([sys_msg, {"role": "user", "content": "Which town is on river 3?"}])
    out["new question"] = {"cold_s": [cold.ttft_s], "hits": [client.turn([sys_msg], "And which one is on river 12?")]}

    history = [system("conversation")]
    hits = [client.turn(history, f"Question {t}: which town is on river {t * 5}?") for t in range(p.turns)]
    out[f"{p.turns}-turn conversation"] = {"cold_s": [hits[0].ttft_s], "hits": hits[1:]}

    histories = [[system(f"interleaved-{i}")] for i in range(p.conversations)]
    colds, hits = [], []
    for t in range(3):
        for history in histories:
            hit = client.turn(history, f"Turn {t}: which town is on river {t + 2}?")
            if t == 0:
                colds.append(hit.ttft_s)
            else:
                hits.append(hit)
    out[f"{p.conversations} interleaved conversations"] = {"cold_s": colds, "hits": hits}

    health = _cache_health(client.server) if client.server.name == OURS else None
    client.server.restart()
    question = "One more question after the restart: which town is on river 9?"
    hit = client.turn(histories[0], question)
    # Its cold baseline: the same conversation under a fresh system prompt (as long; nothing cached).
    cold, _ = client.ask([system("restart-cold"), *histories[0][1:-2], {"role": "user", "content": question}])
    out["first request after a restart"] = {"cold_s": [cold.ttft_s], "hits": [hit]}
    return out, health


def _cache_health(server: Server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()["cache"]


def summarize(result: dict) -> dict:
    """Means of one scenario's result: cold and hit TTFT, their ratio, cached and shared tokens per
    hit (cached None when the server does not report it), and whether both targets are met."""
    hits = [Hit(*h) for h in result["hits"]]
    cold = statistics.mean(result["cold_s"])
    hit = statistics.mean(h.ttft_s for h in hits)
    shared = statistics.mean(h.shared for h in hits)
    reported = all(h.cached is not None for h in hits)
    cached = statistics.mean(h.cached for h in hits) if reported else None
    share = sum(h.cached for h in hits) / sum(h.shared for h in hits) if reported else None
    speedup = cold / max(hit, 1e-9)
    meets = share is not None and share >= TARGET_SHARE and speedup >= TARGET_SPEEDUP
    return {
        "cold_s": cold,
        "hit_s": hit,
        "speedup": speedup,
        "shared": shared,
        "cached": cached,
        "share": share,
        "meets": meets,
    }


def checkpoint_bytes(model_dir: Path, block_size: int = 64, positions: int = 1024) -> dict[str, int]:
    """What one checkpoint of this model holds after `positions` tokens, measured on a real capture:
    its recurrent states, and the window layers' last min(positions, window) positions (what a hit
    at that point needs of them; the blocks hold these, not the checkpoint), and the full-attention
    KV bytes per token."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlx_kvserve.kv import blocks

    model, _ = load(str(model_dir))
    layout = blocks.cache_layout(model, block_size)
    cache = layout.new_cache()
    mx.eval(model(mx.array([[3 + i % 200 for i in range(positions)]]), cache=cache))
    layers = list(zip(layout.specs, layout.capture(cache, positions).layers, cache, strict=True))
    return {
        "state_bytes_per_checkpoint": sum(a.nbytes for s, e, _ in layers if s.kind == blocks.STATE for a in e),
        "window_bytes_per_checkpoint": sum(
            e[1][..., -s.window :, :].nbytes + e[2][..., -s.window :, :].nbytes
            for s, e, _ in layers
            if s.kind == blocks.WINDOW
        ),
        "kv_bytes_per_token": sum(2 * c.keys[..., :1, :].nbytes for s, _, c in layers if s.kind == blocks.KV),
    }


def checkpoint_lines(name: str, size: dict[str, int], health: dict | None, checkpoint_every: int) -> list[str]:
    """The checkpoint figures of one model, each saying what it counts."""
    state, window, kv = (
        size[k] for k in ("state_bytes_per_checkpoint", "window_bytes_per_checkpoint", "kv_bytes_per_token")
    )
    parts = [f"- {name}: full-attention KV {kv} bytes per token"]
    if state:
        parts.append(
            f"one checkpoint holds {state / 1024:.0f} KiB of recurrent state, as much as {state / max(1, kv):.0f} "
            f"tokens of that KV; one every `checkpoint_every = {checkpoint_every}` prompt tokens adds "
            f"{state / checkpoint_every:.0f} bytes per token (more are taken at message starts, prompt and sequence ends)"
        )
    if window:
        parts.append(
            f"the window layers' last `window` positions, which a hit needs: {window / 1024:.0f} KiB, held by the "
            "blocks (a block keeps the part of its window-layer KV still inside a window), no separate state"
        )
    lines = ["; ".join(parts) + "."]
    if health:
        tokens = health["kv_ram_blocks"] * health["block_size"]
        tails, tail_bytes = health["kv_tails"], health["kv_tail_bytes"]
        lines.append(
            f"  /health before the restart: {health['kv_ram_blocks']} blocks of {health['block_size']} tokens, "
            f"{health['kv_ram_bytes'] / max(1, tokens):.0f} bytes per token; {tails} tails (partial last blocks, each "
            f"with the recurrent state at its end on a hybrid) of {tail_bytes / max(1, tails) / 1024:.0f} KiB on "
            f"average: kv_tail_bytes / tokens in blocks = {tail_bytes / max(1, tokens):.0f} bytes per token."
        )
    return lines


def report_lines(results: dict, p: Params, checkpoint_every: int) -> list[str]:
    """The markdown report: one row per model, scenario and server, then the checkpoint figures."""
    lines = [
        f"System prompts of ~{p.system_tokens} tokens, {p.max_tokens} tokens per reply, greedy. Per hit (mean): shared "
        "prefix = the longest common token prefix with an earlier prompt, or an earlier prompt followed by its reply "
        "as the next turn renders it (at most the prompt's length - 1); cached = what the server reported.",
        "",
        "| model | scenario | server | shared prefix | cached | cached / shared | cold TTFT (s) | hit TTFT (s) "
        "| cold / hit | targets |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = [
        "- Replies of random weights are mostly bytes that are not valid UTF-8: the reply text a client sends back "
        "re-tokenizes differently (U+FFFD), so no server can reuse a reply's tokens and a later turn hits at most the "
        "previous prompt: its cached share misses the re-tokenized reply and the 2 template tokens after it."
    ]
    for name, by_server in results.items():
        for server, res in by_server["servers"].items():
            for scenario, r in res.items():
                s = summarize(r)
                reported = s["cached"] is not None
                lines.append(
                    f"| {name} | {scenario} | {server} | {s['shared']:.0f} | "
                    + (f"{s['cached']:.0f} | {s['share']:.0%} | " if reported else "n/a | n/a | ")
                    + f"{s['cold_s']:.2f} | {s['hit_s']:.3f} | {s['speedup']:.1f}x | {'met' if s['meets'] else 'missed'} |"
                )
                if not reported:
                    notes.append(f"- {server} reported no cached tokens ({name}, {scenario}).")
        notes += checkpoint_lines(name, by_server["checkpoint"], by_server.get("health"), checkpoint_every)
    return [*lines, "", *notes]


def run_model(name: str, p: Params) -> dict:
    """Both servers on one model: checkpoint sizes, then every scenario on each server in turn."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_dir = build(name)
    out: dict = {"model_dir": str(model_dir), "checkpoint": checkpoint_bytes(model_dir), "servers": {}}
    tokenizer = load_tokenizer(model_dir)
    servers = start_servers(model_dir)
    try:
        for server in servers:
            res, health = scenarios(Client(server, tokenizer, p.max_tokens), p, f"{server.name}-{time.time()}")
            out["servers"][server.name] = res
            if health is not None:
                out["health"] = health
            for scenario, r in res.items():
                s = summarize(r)
                print(f"{name} | {server.name} | {scenario}: {s}", flush=True)
    finally:
        stop_servers(servers)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~400-token system prompts, 3 turns, 4 conversations")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "families")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    results = {name: run_model(name, p) for name in SHAPES}
    write_report(results, args.out, report_lines(results, p, CacheConfig().checkpoint_every))
    return results


if __name__ == "__main__":
    main()
