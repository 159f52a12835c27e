"""A user's journeys, end to end, each exiting non-zero when a step fails: `journeys.py JOURNEY [flags]`.

  quickstart      the README's and docs/router.md's quick starts, their own command lines run by a shell
  hybrid-restart  a hybrid model's restart as a process: the reply after it equals the cold one
  long-context    long contexts within the memory plan (a compute-free synthetic llama, up to 128k tokens)

`journeys.py JOURNEY --help` lists its flags, e.g.:
    .venv/bin/python scripts/journeys.py quickstart --only readme
"""

from __future__ import annotations

from harness.cli import run_scenario
from harness.journeys import hybrid_restart, long_context, quickstart

SCENARIOS = {"quickstart": quickstart, "hybrid-restart": hybrid_restart, "long-context": long_context}

if __name__ == "__main__":
    run_scenario(__doc__, SCENARIOS)
