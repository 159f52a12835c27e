"""Several models in one server (issue 27), in process through the HTTP app: load time, the cost of a
switch under a budget that holds one model, the hit after a reload (SSD), the memory an unload gives
back, and a small model's TTFT while a large one prefills: on a server of its own (idle, and beside the large
one's own server in another process) and on one server with both, steps running when ready or taking turns,
or the large one in a process of its own (`process = true`).

    .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/features.py models [--out results/models.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
from starlette.testclient import TestClient

from harness.reports import median
from harness.synthetic import llama_config, random_llama, synthetic_model, write_model_folder
from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.batch.step_turns import StepTurns, share_turns
from mlx_kvserve.model_entries import ModelEntry
from mlx_kvserve.registry.front import RoutedEngine
from mlx_kvserve.registry.registry import ModelRegistry
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.model_process import load_entry

LARGE = {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816, "num_attention_heads": 16}
LARGE |= {"num_key_value_heads": 4, "max_position_embeddings": 8192}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build(root: Path, large_shape: str = "") -> dict[str, Path]:
    """The tiny "small" llama and the "large" one: the synthetic 1024-hidden llama, or a random
    4-bit llama of `large_shape` (harness.synthetic SHAPES, e.g. llama3-8b on a GPU)."""
    small = llama_config("tiny", max_position_embeddings=32768)
    if large_shape:
        large_folder = synthetic_model(large_shape, 4, root / "large")
    else:
        large = llama_config("tiny", **LARGE)
        large_folder = write_model_folder(root / "large", large, random_llama(large, seed=1))
    return {
        "small": write_model_folder(root / "small", small, random_llama(small, seed=0, scale=4.0)),
        "large": large_folder,
    }


# A budget both models fit in: the memory plan's (half the memory; engine/memory/plan.py). A fixed 64 GiB
# no longer fits beside the batches: refused on a 16 GB machine, a 15k-token context on an 80 GB GPU.
BOTH_FIT = 0


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 101) % 250 + 3 for i in range(n)]


def ttft(client: TestClient, model: str, tokens: list[int], max_tokens: int = 4) -> tuple[float, dict]:
    """Seconds to the first streamed token, and the usage of the whole reply."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started, first, usage = time.perf_counter(), None, {}
    with client.stream("POST", "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return first or time.perf_counter() - started, usage


def app(
    folders: dict[str, Path], root: Path, budget: int, own_process: frozenset[str] = frozenset()
) -> tuple[TestClient, ModelRegistry]:
    """One server (the HTTP app in this process) with `folders`' models; those in `own_process` are
    served by a process of their own (`process = true`)."""
    overrides = {
        "server": {"model_memory_bytes": budget},
        "ssd": {"cache_dir": str(root / "kv")},
    }
    entries = tuple(ModelEntry(name, str(f), process=name in own_process) for name, f in folders.items())
    registry = ModelRegistry(load_config(overrides=overrides), entries, loader=load_entry)
    client = TestClient(create_app(RoutedEngine(registry), ApiKeys("", ""), registry))
    client.__enter__()
    return client, registry


def switching(folders: dict[str, Path], root: Path) -> dict:
    """A budget for the large model alone: small, large, small again (a reload: SSD hit)."""
    large_bytes = sum(f.stat().st_size for f in folders["large"].glob("*.safetensors"))
    client, registry = app(folders, root / "switch", large_bytes + 2**16)  # the small one's 0.4 MiB do not fit beside
    out: dict = {"rss_start_mib": round(rss_mib(), 1)}
    p_small, p_large = prompt(1024, 1), prompt(1024, 2)
    out["small_cold_ttft_s"], _ = ttft(client, "small", p_small)
    out["small_load_s"] = registry.resolve("small").load_s
    t0 = time.perf_counter()
    out["large_first_ttft_s"], _ = ttft(client, "large", p_large)  # unload small + load large + cold prefill
    out["switch_to_large_total_s"] = time.perf_counter() - t0
    out["large_load_s"] = registry.resolve("large").load_s
    out["rss_large_loaded_mib"] = round(rss_mib(), 1)
    t0 = time.perf_counter()
    out["small_after_reload_ttft_s"], usage = ttft(client, "small", p_small)
    out["switch_to_small_total_s"] = time.perf_counter() - t0
    out["small_after_reload_cached_tokens"] = usage.get("prompt_tokens_details", {}).get("cached_tokens")
    out["rss_small_only_mib"] = round(rss_mib(), 1)  # the large one unloaded
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["loads"] = {r["id"]: (r["loads"], r["unloads"]) for r in registry.describe()["models"]}
    client.__exit__(None, None, None)
    return out


def large_server(folder: Path, root: Path, n: int, repeats: int, conn) -> None:
    """A server of its own for the large model (a child process): on each "go", a cold n-token
    prefill; sends back its TTFT."""
    os.environ["MLX_KVSERVE_HOME"] = str(root / "home-large")
    client, _ = app({"large": folder}, root / "large-own", BOTH_FIT)
    ttft(client, "large", prompt(64, 9))
    conn.send("ready")
    for i in range(repeats):
        conn.recv()
        conn.send(ttft(client, "large", prompt(n, 300 + i), 1)[0])
    client.__exit__(None, None, None)


def small_during(client: TestClient, start_large, wait_large, seed: int) -> float:
    """The small model's TTFT (a cold 256-token prompt) 0.5 s after a large cold prefill started."""
    start_large()
    time.sleep(0.5)  # the large prefill is under way
    took = ttft(client, "small", prompt(256, seed))[0]
    wait_large()
    return took


def beside_in_process(client: TestClient, n: int, seed: int, large: list[float]) -> float:
    """small_during, the large prefill on the same server (another HTTP thread)."""
    big = threading.Thread(target=lambda: large.append(ttft(client, "large", prompt(n, seed), 1)[0]))
    return small_during(client, big.start, big.join, seed)


def fairness(folders: dict[str, Path], root: Path, repeats: int = 3, n: int = 2048) -> dict:
    """The small model's TTFT while the large one prefills a cold n-token prompt, in one run: on a
    server of its own (idle, then beside the large one's own server, another process), and on one
    server with both models, their steps running when ready (before) or taking turns (after)."""
    import multiprocessing

    out: dict = {"load_avg_start": os.getloadavg()}
    own, _ = app({"small": folders["small"]}, root / "small-own", BOTH_FIT)
    ttft(own, "small", prompt(64, 9))
    out["small_alone"] = median([ttft(own, "small", prompt(256, 100 + i))[0] for i in range(repeats)])
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=large_server, args=(folders["large"], root, n, repeats, child))
    proc.start()
    parent.recv()
    large: list[float] = []
    runs = [
        small_during(own, lambda: parent.send("go"), lambda: large.append(parent.recv()), 400 + i)
        for i in range(repeats)
    ]
    proc.join()
    own.__exit__(None, None, None)
    out["two_servers"] = {"small_ttft_s": median(runs), "large_ttft_s": median(large)}
    print("small alone", out["small_alone"], "two servers", out["two_servers"], flush=True)
    client, registry = app(folders, root / "fair", BOTH_FIT)
    ttft(client, "small", prompt(64, 9))
    ttft(client, "large", prompt(64, 9))  # both loaded and warm
    for k, (mode, turns) in enumerate((("one_server_no_turns", None), ("one_server_turns", StepTurns()))):
        registry.turns = turns
        for _, engine in registry.loaded_engines():
            share_turns(engine, turns)
        large = []
        runs = [beside_in_process(client, n, 500 + 10 * k + i, large) for i in range(repeats)]  # cold prompts
        out[mode] = {"small_ttft_s": median(runs), "large_ttft_s": median(large)}
        print(mode, out[mode], flush=True)
    client.__exit__(None, None, None)
    client, registry = app(folders, root / "fair-process", BOTH_FIT, frozenset({"large"}))
    ttft(client, "small", prompt(64, 9))
    ttft(client, "large", prompt(64, 9))
    large = []
    runs = [beside_in_process(client, n, 600 + i, large) for i in range(repeats)]
    out["one_server_large_in_own_process"] = {"small_ttft_s": median(runs), "large_ttft_s": median(large)}
    print("one_server_large_in_own_process", out["one_server_large_in_own_process"], flush=True)
    client.__exit__(None, None, None)
    modes = ("two_servers", "one_server_no_turns", "one_server_turns", "one_server_large_in_own_process")
    for mode in modes:
        out[mode]["ratio_to_alone"] = round(out[mode]["small_ttft_s"] / out["small_alone"], 2)
    out["large_in_own_process_vs_two_servers"] = round(
        out["one_server_large_in_own_process"]["small_ttft_s"] / out["two_servers"]["small_ttft_s"], 2
    )
    out["load_avg_end"] = os.getloadavg()
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-fairness", action="store_true")
    parser.add_argument("--skip-switching", action="store_true")
    parser.add_argument("--prefill", type=int, default=2048, help="the large model's cold prompt, in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large", default="", help="a synthetic shape for the large model (e.g. llama3-8b)")


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["MLX_KVSERVE_HOME"] = str(root / "home")
        folders = build(root / "models", args.large)
        results: dict = {"device": str(mx.default_device())}
        if not args.skip_switching:
            results["switching"] = switching(folders, root)
        if not args.skip_fairness:
            results["fairness"] = fairness(folders, root, args.repeats, args.prefill)
    text = json.dumps(results, indent=2, default=lambda v: round(v, 3))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
