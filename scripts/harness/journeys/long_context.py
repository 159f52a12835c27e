"""Long contexts within the memory plan (issue 45 item 6), on this machine, once and briefly.

A compute-free synthetic llama: its attention returns the queries (no scores, so a 64k-token prefill is
not hours of O(n^2) work on a CPU) while every layer's keys and values still go into the cache at their
real size; tiny projections (hidden size 64) and a byte vocabulary. What runs is the server's own path:
the memory plan at start, the context it serves, the prefill into mlx-lm's batch, the KV it holds.

Cases (each a fresh Engine behind the app, in this process, one after another):
One request at a time ([server] max_batch = 1), the block cache off (the batch's KV is what is measured),
4096-token prefill steps.
- `realistic`: 128 KiB of KV per token (32 layers x 4 KV heads x 128 dims x float32, Llama-3-8B's bytes),
  a 64k-token prompt: 8 GiB of KV.
- `long`: 16 KiB per token (4 layers), a 128k-token prompt: 2 GiB.
- `refused`: a model of 320 KiB per token (80 layers, a 70B's KV) with [server] kv_batch_bytes past the
  machine: refused at start with the numbers; and a 128k-token prompt (40 GiB of KV) on it with the plan's
  own budget: refused before any work (past the context the plan holds).
For each: the plan's line, the prompt's answer, wall time, MLX's peak memory and the process's peak RSS.

    .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/journeys.py long-context [--cases ...]

Checks the machine's available memory first and skips a case whose KV, twice at its peak, would not leave
4 GiB free.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from starlette.testclient import TestClient

from harness.long_context import make_compute_free
from harness.synthetic import llama_config, random_llama, write_model_folder
from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.memory.facts import available_memory_bytes
from mlx_kvserve.engine.memory.plan import GROWTH_COPIES
from mlx_kvserve.errors import ConfigError
from mlx_kvserve.models.loader import load_model
from mlx_kvserve.server.app import create_app

GIB = 1024**3
KEEP_FREE = 4 * GIB  # what a case leaves the machine's other users at its peak (estimated)
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4}
SHAPE |= {"head_dim": 128, "vocab_size": 0, "rope_theta": 10000.0}
CASES = {  # layers, context, prompt tokens, extra config
    "realistic": (32, 65536, 65536 - 64, {}),
    "long": (4, 131072, 131072 - 64, {}),
}


def model_folder(root: Path, layers: int, context: int) -> Path:
    config = llama_config("tiny", **SHAPE, num_hidden_layers=layers, max_position_embeddings=context)
    return write_model_folder(root / f"l{layers}", config, random_llama(config, dtype=mx.float32))


def engine_for(folder: Path, home: Path, **overrides) -> Engine:
    # One request at a time (max_batch 1), the block cache off: the batch's KV is what is measured.
    # 4096-token prefill steps: mlx-lm's batch cache grows by a copy of itself each step (O(n^2) bytes moved).
    base = {"server": {"max_batch": 1}, "cache": {"enabled": False}, "ssd": {"enabled": False}}
    base["generation"] = {"prefill_step_size": 4096}
    for section, values in overrides.items():
        base[section] = base.get(section, {}) | values
    config = load_config(overrides=base | {"model": {"path": str(folder)}})
    loaded = load_model(str(folder), home / "models", "float32")
    return Engine(loaded, config)


def run_prompt(engine: Engine, num_tokens: int) -> dict:
    mx.reset_peak_memory()
    started = time.perf_counter()
    with TestClient(create_app(engine, ApiKeys("", "")), base_url="http://127.0.0.1") as client:
        prompt = [(i * 7919) % 250 + 3 for i in range(num_tokens)]
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        health = client.get("/health").json()
    body = reply.json()
    return {
        "status": reply.status_code,
        "prompt_tokens": body.get("usage", {}).get("prompt_tokens"),
        "error": body.get("error", {}).get("message"),
        "wall_s": round(time.perf_counter() - started, 1),
        "mlx_peak_gib": round(mx.get_peak_memory() / GIB, 2),
        "context_served": health["context_length"],
    }


def case(name: str, root: Path, home: Path, scale: float) -> dict:
    layers, context, tokens, _ = CASES[name]
    tokens = int(tokens * scale)
    kv = tokens * 2 * layers * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 4
    free = available_memory_bytes(0)
    if free - GROWTH_COPIES * kv < KEEP_FREE:  # at its peak the batch holds its KV twice (memory_plan.py)
        left = (free - GROWTH_COPIES * kv) / GIB
        return {"case": name, "skipped": f"{kv / GIB:.2f} GiB of KV, twice at its peak, would leave {left:.2f} GiB"}
    engine = engine_for(model_folder(root, layers, context), home)
    try:
        out = {"case": name, "kv_gib": round(kv / GIB, 2), "plan": engine.memory_plan.line()}
        out |= run_prompt(engine, tokens)
    finally:
        engine.stop(10)
    return out


def refused(root: Path, home: Path) -> list[dict]:
    folder = model_folder(root, 80, 131072)  # 320 KiB of KV per token (a 70B's): 40 GiB at 128k tokens
    out = []
    try:
        engine_for(folder, home, server={"kv_batch_bytes": "64GiB"})
        out.append({"case": "refused-setting", "refused": False})
    except ConfigError as exc:
        out.append({"case": "refused-setting", "refused": True, "message": exc.message})
    engine = engine_for(folder, home)
    try:
        if engine.context_length >= 131072 - 64:  # never prefilled: 16 GiB of KV
            return out + [{"case": "refused-prompt", "skipped": f"the plan holds {engine.context_length} tokens"}]
        result = run_prompt(engine, 131072 - 64)  # past the plan's context: a 400 before any work
        out.append({"case": "refused-prompt", "plan": engine.memory_plan.line()} | result)
    finally:
        engine.stop(10)
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", nargs="+", default=["refused", "long", "realistic"])
    parser.add_argument("--scale", type=float, default=1.0, help="prompts this share of their length (a trial run)")


def run(args: argparse.Namespace) -> None:
    make_compute_free()
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        root, home = Path(tmp) / "models", Path(tmp) / "home"
        os.environ["MLX_KVSERVE_HOME"] = str(home)
        for name in args.cases:
            rows = refused(root, home) if name == "refused" else [case(name, root, home, args.scale)]
            for row in rows:
                row["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)
                print(json.dumps(row), flush=True)
