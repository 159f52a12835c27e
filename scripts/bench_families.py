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

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_families.py [--quick] [--out DIR]

Targets (issue 12): cached tokens >= 90% of the shared prefix in every scenario; hit TTFT >= 5x below cold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
from harness import OURS, ROOT
from harness.families import FULL, QUICK, Client, Params, checkpoint_bytes, report_lines, summarize, system_text
from harness.reports import write_report
from harness.servers import Server, start_servers, stop_servers
from harness.synthetic import family_config, random_model, write_model_folder

from mlx_kvserve.config import CacheConfig

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


def build(name: str) -> Path:
    """The model folder of SHAPES[name], written once (the folder name carries the shape)."""
    family, shape = SHAPES[name]
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    folder = ROOT / "results" / "models" / f"bench-{family}-{digest}"
    if not (folder / "model.safetensors").exists():
        config = family_config(family, **shape)
        write_model_folder(folder, config, random_model(config, scale=1.0))
    return folder


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
