"""Agent sessions against our server and its peers: `agents.py SCENARIO [flags]`.

  session   a Claude Code-shaped session (its system prompt, tool schemas and billing line, 10 turns) on
            mlx-kvserve, mlx_lm.server and optionally vllm-mlx, one after the other, over /v1/messages
            or chat: the later turns' TTFT against the peers' (docs/benchmarks.md "Agent sessions")

`agents.py session --help` lists its flags.
"""

from __future__ import annotations

from harness import agent_session
from harness.cli import run_scenario

SCENARIOS = {"session": agent_session}

if __name__ == "__main__":
    run_scenario(__doc__, SCENARIOS)
