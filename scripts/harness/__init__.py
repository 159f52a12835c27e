"""The code behind scripts/' entry points, shared with the tests (tests/conftest.py puts scripts/ on sys.path).

An entry point is `SCRIPT SCENARIO [flags]` (cli.py); each scenario is a module with `add_args(parser)` and
`run(args)`: engine/ (bench_engine.py), features/ (features.py), journeys/ (journeys.py), agent_session.py and
agent_clients.py (agents.py), tiny_vlm.py (features.py tiny-vlm); scenarios/: the server suite's (bench.py).
No script imports another; they share these:
  servers.py    server processes: free port, start, wait ready, restart, stop; the pair ours + mlx_lm.server,
                and vllm-mlx from a scratch venv as a third; variants.py: ours configured otherwise
  clients.py    streamed chat requests timed to the first token
  reports.py    medians, results.json + report.md
  prompts.py    the benches' system prompts and questions
  synthetic.py  random-weight models with a byte tokenizer (no download)
  kvstack.py    the engine's Scheduler on a fresh block cache, no server
  diskio.py     raw disk reads and writes, page-cache drops: the floors the SSD scenarios compare with
  restart.py    requests sent to an in-process engine, timed to the first token
  hits.py, long_context.py  what the lengths scenario counts (arrays joined, peak RSS, compute-free attention)
  agent_model.py  the agent session's model; agent_recorder.py the recorded session; journey.py the hybrid restart's
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # mlx_kvserve without an install (a GPU machine's plain python3)

OURS, THEIRS, VLLM = "mlx-kvserve", "mlx_lm.server", "vllm-mlx"  # the server names in every results.json


def default_model_dir() -> Path:
    """The default model (SmolLM2-135M, float32), fetched and converted once into the user's cache."""
    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.default import ensure_default_model

    return ensure_default_model(default_home() / "models", "float32")
