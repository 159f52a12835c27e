"""Agent sessions and agent clients against our server: `agents.py SCENARIO [flags]`.

  session   a Claude Code-shaped session (its system prompt, tool schemas and billing line, 10 turns) on
            mlx-kvserve, mlx_lm.server and optionally vllm-mlx, one after the other, over /v1/messages
            or chat: the later turns' TTFT against the peers' (docs/benchmarks.md "Agent sessions")
  clients   the real agent clients (Claude Code, Codex, opencode, Qwen Code, Cline, aider, llm) and SDKs run
            for two turns against our server: works, turn 2's cached share; --record refreshes
            tests/data/client_requests/ (docs/agent-clients.md)
  record    a real Claude Code session through a scripted task (its tool calls run for real), every request
            kept: what `session --session` replays

`agents.py SCENARIO --help` lists its flags.
"""

from __future__ import annotations

from harness import agent_clients, agent_recorder, agent_session
from harness.cli import run_scenario

SCENARIOS = {"session": agent_session, "clients": agent_clients, "record": agent_recorder}

if __name__ == "__main__":
    run_scenario(__doc__, SCENARIOS)
