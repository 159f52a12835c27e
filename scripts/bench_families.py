"""Hybrid and sliding-window models, mlx-kvserve vs mlx_lm.server on the same model, in one run (issue 12).

Two random-weight models at a size this CPU prefills in seconds: a hybrid (qwen3_5: Gated DeltaNet layers
with full attention every 4th layer) and a sliding-window model (gemma3_text: 5 of 6 layers see a 256-token
window). Scenarios, each on both servers: an exact repeat of a chat with a long system prompt, a new question
on the same system prompt, a 6-turn conversation, 12 interleaved conversations (3 turns each, round robin),
and the first request after a restart. Per scenario: mean TTFT of the hits vs the cold first request, and
the cached tokens each server reports against the prefix the prompt shares with what came before.

    python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_families.py [--quick]

Targets (issue 12): cached tokens >= 90% of the shared prefix in every scenario; hit TTFT >= 5x below cold.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import ROOT, median, write_report
from bench_prefix import Server, free_port, stream_chat

from mlx_kvserve.blas import preload_env
from mlx_kvserve.models.synthetic import family_config, random_model, write_model_folder

SHAPES = {
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
            "num_hidden_layers": 6,
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
SYSTEM = "You answer questions about rivers. " + " ".join(
    f"Rule {i}: the river number {i} flows to the town number {i * 7} in the valley." for i in range(40)
)


def build(name: str) -> Path:
    family, shape = SHAPES[name]
    folder = ROOT / "results" / "models" / f"bench-{family}"
    if not (folder / "model.safetensors").exists():
        config = family_config(family, **shape)
        write_model_folder(folder, config, random_model(config, scale=1.0))
    return folder


def start(model_dir: Path) -> list[Server]:
    env = preload_env({**os.environ, "PYTHONUNBUFFERED": "1"})
    ours_port, theirs_port = free_port(), free_port()
    ours = Server(
        "mlx-kvserve",
        [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model_dir), "--port", str(ours_port)],
        ours_port,
        {**env, "MLX_KVSERVE_HOME": tempfile.mkdtemp(prefix="fam-")},
        "/health",
    )
    theirs = Server(
        "mlx_lm.server",
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(theirs_port)],
        theirs_port,
        env,
        "/v1/models",
    )
    for s in (ours, theirs):
        s.wait(s.ready_path)
        stream_chat(s, [{"role": "user", "content": "warm up"}], 2)
    return [ours, theirs]


def tokens_of(model_dir: Path, messages: list[dict], generation_prompt: bool = True) -> int:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = _TOKENIZERS.setdefault(str(model_dir), load_tokenizer(model_dir))
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt))


_TOKENIZERS: dict = {}


def ask(server: Server, messages: list[dict], max_tokens: int) -> tuple[float, int | None, str]:
    reply = stream_chat(server, messages, max_tokens)
    return reply.ttft_s, reply.cached_tokens, reply.text


def scenarios(server: Server, model_dir: Path, turns: int, conversations: int, max_tokens: int) -> dict:
    """Every scenario on one server; each gets its own system prompt (a cold start)."""
    out: dict = {}

    def system(tag: str) -> dict:
        return {"role": "system", "content": f"Session {tag} {time.time()}. {SYSTEM}"}

    def record(name: str, cold: float, hits: list[tuple[float, int | None, int]]) -> None:
        out[name] = {
            "cold_s": cold,
            "hit_s": median([h[0] for h in hits]),
            "cached": [h[1] for h in hits],
            "shared": [h[2] for h in hits],
        }

    sys_msg = system("repeat")
    chat = [sys_msg, {"role": "user", "content": "Which town is on river 3?"}]
    cold, _, _ = ask(server, chat, max_tokens)
    t, c, _ = ask(server, chat, max_tokens)
    record("repeat", cold, [(t, c, tokens_of(model_dir, chat) - 1)])

    sys_msg = system("question")
    cold, _, _ = ask(server, [sys_msg, {"role": "user", "content": "Which town is on river 3?"}], max_tokens)
    chat = [sys_msg, {"role": "user", "content": "And which one is on river 12?"}]
    t, c, _ = ask(server, chat, max_tokens)
    record("new question", cold, [(t, c, tokens_of(model_dir, [sys_msg], False))])

    history = [system("conversation")]
    hits, cold = [], 0.0
    for turn in range(turns):
        before = list(history)
        history.append({"role": "user", "content": f"Question {turn}: which town is on river {turn * 5}?"})
        t, c, text = ask(server, history, max_tokens)
        if turn == 0:
            cold = t
        else:
            hits.append((t, c, tokens_of(model_dir, before, False)))
        history.append({"role": "assistant", "content": text})
    record(f"{turns}-turn conversation", cold, hits)

    histories = [[system(f"inter-{i}")] for i in range(conversations)]
    colds, hits = [], []
    for turn in range(3):
        for h in histories:
            before = list(h)
            h.append({"role": "user", "content": f"Turn {turn}: which town is on river {turn + 2}?"})
            t, c, text = ask(server, h, max_tokens)
            if turn == 0:
                colds.append(t)
            else:
                hits.append((t, c, tokens_of(model_dir, before, False)))
            h.append({"role": "assistant", "content": text})
    record(f"{conversations} interleaved conversations", median(colds), hits)

    chat = [histories[0][0], {"role": "user", "content": "One more question after the restart?"}]
    server.restart()
    t, c, _ = ask(server, chat, max_tokens)
    record("first request after a restart", median(colds), [(t, c, tokens_of(model_dir, [histories[0][0]], False))])
    return out


def checkpoint_bytes(model_dir: Path) -> dict[str, int]:
    """What one checkpoint of this model stores (its recurrent states and its windows' contents) and
    the full-attention KV per token, measured on a real capture of the model's cache."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlx_kvserve.kv import blocks

    model, _ = load(str(model_dir))
    layout = blocks.cache_layout(model, 64)
    cache = layout.new_cache()
    mx.eval(model(mx.array([list(range(3, 1027))]), cache=cache))  # 1024 tokens: every window full
    capture = layout.capture(cache, 1024)
    state = sum(
        a.nbytes for spec, e in zip(layout.specs, capture.layers, strict=True) if spec.kind == "state" for a in e
    )
    window = sum(
        e[1].nbytes + e[2].nbytes for spec, e in zip(layout.specs, capture.layers, strict=True) if spec.kind == "window"
    )
    kv = sum(c.keys[..., :1, :].nbytes * 2 for spec, c in zip(layout.specs, cache, strict=True) if spec.kind == "kv")
    return {"state_bytes_per_checkpoint": state, "window_bytes_per_checkpoint": window, "kv_bytes_per_token": kv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 turns, 4 interleaved conversations")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "families")
    args = ap.parse_args()
    turns, conversations, max_tokens = (3, 4, 8) if args.quick else (6, 12, 16)
    results: dict = {}
    lines = [
        "| model | scenario | server | cold TTFT (s) | hit TTFT (s) | cold / hit | cached / shared prefix |",
        "|---|---|---|---|---|---|---|",
    ]
    sizes = []
    for name in SHAPES:
        model_dir = build(name)
        size = checkpoint_bytes(model_dir)
        results.setdefault(name, {})["checkpoint"] = size
        sizes.append(
            f"- {name}: a checkpoint stores {size['state_bytes_per_checkpoint'] / 1024:.0f} KiB of recurrent state "
            f"and {size['window_bytes_per_checkpoint'] / 1024:.0f} KiB of window contents (kept in the blocks); "
            f"full-attention KV is {size['kv_bytes_per_token']} bytes per token, so a checkpoint weighs as much as "
            f"{(size['state_bytes_per_checkpoint'] / max(1, size['kv_bytes_per_token'])):.0f} tokens of KV"
        )
        servers = start(model_dir)
        try:
            for server in servers:
                res = scenarios(server, model_dir, turns, conversations, max_tokens)
                results.setdefault(name, {})[server.name] = res
                if server.name == "mlx-kvserve":
                    cache = httpx.get(server.url + "/health", timeout=30).json()["cache"]
                    results[name]["cache"] = {k: cache.get(k) for k in ("layers", "kv_tails", "kv_tail_bytes")}
                for scenario, r in res.items():
                    known = [(c, s) for c, s in zip(r["cached"], r["shared"], strict=True) if c is not None]
                    share = sum(c for c, _ in known) / max(1, sum(s for _, s in known)) if known else None
                    lines.append(
                        f"| {name} | {scenario} | {server.name} | {r['cold_s']:.2f} | {r['hit_s']:.3f} | "
                        f"{r['cold_s'] / max(r['hit_s'], 1e-9):.1f}x | "
                        + (f"{share:.0%} |" if share is not None else "not reported |")
                    )
        finally:
            for s in servers:
                s.stop()
    write_report(results, args.out, [*lines, "", *sizes])


if __name__ == "__main__":
    main()
