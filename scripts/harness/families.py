"""bench_families.py's pieces that need no server: its parameters, system prompts, the client that measures
each request's shared prefix, the summary of a scenario against the targets, the checkpoint sizes of a
model and the report (checked by the tests on tiny models)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, NamedTuple

from harness.clients import stream_chat
from harness.servers import Server
from mlx_kvserve.kv.tails import common_prefix

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
