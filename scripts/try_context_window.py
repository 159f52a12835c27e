"""A real Claude Code session crossing the served context (issue 45): does it compact, or is it lost?

Starts `mlx-kvserve run` on the random-weight model of try_clients.py (SmolLM2's tokenizer, one layer,
so a ~40k-token prompt prefills in seconds on the CPU) with `[model] context_length` set, then runs
`claude -p "say hi"` and TURNS more `claude -c -p` turns that each add 7000 words of notes. Prints each
turn's exit status, the server's answers (status, prompt tokens, error) and how many times Claude Code
wrote "Conversation compacted" into its transcript. Extra `NAME=VALUE` arguments go into Claude Code's
environment (e.g. CLAUDE_CODE_MAX_CONTEXT_TOKENS=36000). Needs Claude Code on PATH or --claude; not
part of the test suite.

    python scripts/try_context_window.py --context 36000
    python scripts/try_context_window.py --context 36000 CLAUDE_CODE_MAX_CONTEXT_TOKENS=36000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness import ROOT
from harness.agent_model import build_model
from harness.servers import Server, free_port, server_env, toml_text

WORDS = "apples pears plums grapes lemons melons cherries figs dates limes".split()
REQUEST = re.compile(r"endpoint=/v1/messages status=(\d+) .*?prompt_tokens=(\S+) .*?error=(\S+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=36000, help="[model] context_length of the server")
    parser.add_argument("--turns", type=int, default=4, help="turns after the first, each adding 7000 words")
    parser.add_argument("--claude", default=shutil.which("claude") or "claude", help="the Claude Code executable")
    parser.add_argument("--model", default=str(Path.home() / ".cache" / "mlx-kvserve-try-context" / "model"))
    parser.add_argument("env", nargs="*", help="NAME=VALUE for Claude Code's environment")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="try-context-"))
    model = build_model(Path(args.model), 131072, 12.0)
    (work / "config.toml").write_text(toml_text({"model": {"context_length": args.context}, "ssd": {"enabled": False}}))
    port = free_port()
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "mlx_kvserve", "run", "--model", str(model)]
    cmd += ["--port", str(port), "--config", str(work / "config.toml")]
    server = Server("ours", cmd, port, server_env() | {"MLX_KVSERVE_HOME": str(work / "server")}, "/health")
    home, project = work / "home", work / "project"
    for folder in (home, project):
        folder.mkdir()
    (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True, "numStartups": 5}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env |= {"HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_AUTH_TOKEN": "unused", "NO_COLOR": "1"}
    env |= {k: "default" for k in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")}
    env |= {"DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "TERM": "dumb"}
    env |= dict(pair.split("=", 1) for pair in args.env)
    notes = " ".join(random.Random(1).choice(WORDS) for _ in range(7000))
    turns = [["-p", "say hi"]] + [["-c", "-p", f"Here are my notes: {notes}. Count the fruits."]] * args.turns
    try:
        server.wait("/health")
        for i, turn in enumerate(turns, 1):
            done = subprocess.run(
                [args.claude, *turn], cwd=project, env=env, capture_output=True, text=True, timeout=900
            )
            last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
            print(f"turn {i}: exit {done.returncode}  {last[0][:160]}", flush=True)
    finally:
        server.stop()
    server.log.seek(0)
    for status, prompt, error in REQUEST.findall(server.log.read()):
        print(f"  /v1/messages {status} prompt_tokens={prompt} error={error}")
    transcripts = list((home / ".claude" / "projects").rglob("*.jsonl"))
    compacted = sum(p.read_text().count('"content":"Conversation compacted"') for p in transcripts)
    print(f"compactions recorded by Claude Code: {compacted}; files under {work}")


if __name__ == "__main__":
    main()
