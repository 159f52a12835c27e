"""One rank of a distributed engine, for tests/engine/test_distributed.py (run under `mlx.launch`).

    python dist_rank.py MODEL_DIR HOME MODE PROMPTS_JSON [--pin]

Every rank loads its shard and builds the engine; rank 0 runs each prompt of PROMPTS_JSON (lists
of token ids) greedily through the worker, in order, then (with --pin) pins the first prompt's
blocks on every rank, and prints one `RESULT <json>` line: the completions, their cached tokens
and every rank's cache statistics. Each rank writes its SSD folder to HOME/rank<r>.dir.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path


def main() -> None:
    model_dir, home, mode, prompts_file = sys.argv[1:5]
    os.environ["MLX_KVSERVE_HOME"] = home
    import mlx.core as mx

    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.distributed import World
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.engine.request import GenerationRequest, SamplingParams
    from mlx_kvserve.models.loader import load_model

    world = World(mx.distributed.init(), mode)
    config = load_config(overrides={"cache": {"block_size": 16}, "ssd": {"cache_dir": f"{home}/kv"}})
    loaded = load_model(model_dir, Path(home) / "models", "float32", "", (world.group, mode))
    engine = Engine(loaded, config, world)
    tier = engine.prefix_cache.ssd_tier
    Path(home, f"rank{world.rank}.dir").write_text(str(tier.store.cache_dir))
    if world.rank != 0:
        engine.serve_follower()
        return
    engine.start()
    results = []
    for prompt in json.loads(Path(prompts_file).read_text()):
        done, events = threading.Event(), []
        params = SamplingParams(max_tokens=10)
        engine.submit(GenerationRequest("t", prompt, params, events.append, on_done=done.set))
        assert done.wait(120), "no answer"
        end = events[-1]
        results.append({"tokens": list(end.token_ids), "cached": end.usage.cached_tokens})
    pinned = None
    admin = engine.cache_admin()
    hashes = admin.block_hashes(json.loads(Path(prompts_file).read_text())[0])
    if "--pin" in sys.argv:
        pinned = admin.pin(hashes, True)["pinned_count"]
    stats = engine.cache_stats()
    report = {"results": results, "pinned": pinned, "ranks": stats.get("ranks"), "hashes": [h.hex() for h in hashes]}
    print("RESULT " + json.dumps(report), flush=True)
    engine.stop(30)


if __name__ == "__main__":
    main()
