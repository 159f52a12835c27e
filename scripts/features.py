"""Features measured one at a time, as named scenarios: `features.py SCENARIO [flags]`.

  tiny-vlm       build a tiny random-weight vision-language model folder (gemma3 or qwen2_vl) for
                 `mlx-kvserve run` (docs/vision.md)
  models         several models in one server: load, switch, reload from the SSD, a small model's TTFT
                 while a large one prefills (the GPU run's `models` step)
  model-threads  two mlx-lm BatchGenerators in one process or two, no mlx-kvserve code (the GPU run's
                 `model_threads` step: why a large model gets a process of its own)

`features.py SCENARIO --help` lists a scenario's flags. Run under OpenBLAS on a CPU:
    .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/features.py models --skip-switching
"""

from __future__ import annotations

from harness import tiny_vlm
from harness.cli import run_scenario
from harness.features import model_threads, models

SCENARIOS = {"tiny-vlm": tiny_vlm, "models": models, "model-threads": model_threads}

if __name__ == "__main__":
    run_scenario(__doc__, SCENARIOS)
