"""The engine's own timings, in process (no HTTP), as named scenarios: `bench_engine.py SCENARIO [flags]`.

  lengths     long prompts at a real model shape (synthetic, no download): cold, RAM hit, exact repeat,
              SSD hit and restore after a restart against their floors, mlx-lm's one-cache path;
              the GPU run's `engine` step, and long contexts on a CPU with --compute-free
  hit-blocks  a cache hit's cost against the block size (16 / 64 / 256) on a deep narrow model
  restore     a restore after a restart with a realistic KV (128 KiB/token) next to its floor (raw cold
              read + RAM hit); --before: the per-block read path, alternated
  ssd-io      the SSD store without a model: save and load next to the raw disk, block checksums

`bench_engine.py SCENARIO --help` lists a scenario's flags. Run under OpenBLAS on a CPU:
    .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_engine.py hit-blocks
"""

from __future__ import annotations

from harness.cli import run_scenario
from harness.engine import hit_blocks, lengths, restore, ssd_io

SCENARIOS = {"lengths": lengths, "hit-blocks": hit_blocks, "restore": restore, "ssd-io": ssd_io}

if __name__ == "__main__":
    run_scenario(__doc__, SCENARIOS)
