"""Support code shared by the bench and journey scripts and by the tests.

Every script in scripts/ imports what it shares from here, never from another script, and the tests
import it too (tests/conftest.py puts scripts/ on sys.path). Modules:
  servers.py    server processes: free port, start, wait ready, restart, stop; the pair ours + mlx_lm.server,
                and vllm-mlx from a scratch venv as a third
  clients.py    streamed chat requests timed to the first token
  reports.py    medians, results.json + report.md
  prompts.py    the benches' system prompts and questions
  synthetic.py  random-weight models with a byte tokenizer (no download)
  kvstack.py    the engine's Generator on a fresh block cache, no server
  diskio.py     raw disk reads and writes, page-cache drops: the floors the SSD benches compare with
  restart.py    in-process engines on a cache folder, restarted (bench_restart_hit, bench_write_interference)
  scenarios/    the measurements bench.py runs together and each single-topic bench runs alone
  agent_model.py the random model try_clients.py and bench_claude_session.py serve to agent clients
  client_requests.py  real clients' recorded requests (tests/data/client_requests/), which the tests replay
  agent_workload.py, agent_summary.py, families.py, grammar_libraries.py, grammar_compare.py, journey.py:
                one bench's workload and arithmetic each, here so that the tests check them without servers
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
