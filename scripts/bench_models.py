"""Several models in one server (issue 27), in process through the HTTP app: load time, the cost of a
switch under a budget that holds one model, the hit after a reload (SSD), the memory an unload gives
back, and a small model's TTFT while a large one prefills (one worker thread per engine).

    .venv/bin/python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_models.py [--out results/models.json]
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

from harness.reports import median
from harness.synthetic import llama_config, random_llama, write_model_folder
from starlette.testclient import TestClient

from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.model_front import RoutedEngine
from mlx_kvserve.engine.registry import ModelRegistry
from mlx_kvserve.model_entries import ModelEntry
from mlx_kvserve.server.app import create_app

LARGE = {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816, "num_attention_heads": 16}
LARGE |= {"num_key_value_heads": 4, "max_position_embeddings": 8192}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build(root: Path) -> dict[str, Path]:
    small = llama_config("tiny", max_position_embeddings=8192)
    large = llama_config("tiny", **LARGE)
    return {
        "small": write_model_folder(root / "small", small, random_llama(small, seed=0, scale=4.0)),
        "large": write_model_folder(root / "large", large, random_llama(large, seed=1)),
    }


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


def app(folders: dict[str, Path], root: Path, budget: int) -> tuple[TestClient, ModelRegistry]:
    overrides = {
        "server": {"model_memory_bytes": budget},
        "ssd": {"cache_dir": str(root / "kv")},
    }
    entries = tuple(ModelEntry(name, str(folder)) for name, folder in folders.items())
    registry = ModelRegistry(load_config(overrides=overrides), entries)
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


def fairness(folders: dict[str, Path], root: Path, repeats: int = 2, n: int = 2048) -> dict:
    """Both loaded: the small model's TTFT alone, and while the large one prefills a cold prompt."""
    client, _ = app(folders, root / "fair", 2**36)
    ttft(client, "small", prompt(64, 9))
    ttft(client, "large", prompt(64, 9))  # both loaded and warm
    alone, during, large_alone, large_during = [], [], [], []
    for i in range(repeats):
        alone.append(ttft(client, "small", prompt(256, 100 + i))[0])
        large_alone.append(ttft(client, "large", prompt(n, 200 + i), 1)[0])
        got: list[float] = []
        big = threading.Thread(target=lambda i=i, got=got: got.append(ttft(client, "large", prompt(n, 300 + i), 1)[0]))
        big.start()
        time.sleep(0.5)  # the large prefill is under way
        during.append(ttft(client, "small", prompt(256, 400 + i))[0])
        big.join()
        large_during.extend(got)
    client.__exit__(None, None, None)
    return {
        "small_ttft_alone_s": median(alone),
        "small_ttft_during_large_prefill_s": median(during),
        "ratio": round(median(during) / median(alone), 2),
        "large_ttft_alone_s": median(large_alone),
        "large_ttft_with_small_s": median(large_during),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-fairness", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["MLX_KVSERVE_HOME"] = str(root / "home")
        folders = build(root / "models")
        results = {"switching": switching(folders, root)}
        if not args.skip_fairness:
            results["fairness"] = fairness(folders, root)
    text = json.dumps(results, indent=2, default=lambda v: round(v, 3))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
