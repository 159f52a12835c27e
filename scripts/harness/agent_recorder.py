"""Records a real Claude Code session for `agents.py session --session` (issue 44): Claude Code, launched as the
README says (`mlx-kvserve launch claude`), works in a copy of this repository's files through a scripted task.
Its main requests (those offering the Bash tool) are answered by the script: each turn a short text and one tool
call (Bash, Read) that Claude Code runs for real and sends back as a tool_result, then a last text answer. Its
other requests (a title, a command's prefix) go on to `mlx-kvserve run` with agents.py's compute-free model.
Every request body is kept in order under OUT/requests/ (NNN-POST_v1_messages.json), which `agents.py session
--session OUT/requests` replays on each server. A client not installed is named with its install command.

    scripts/agents.py record [--out results/claude-recording]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import ROOT
from harness.agent_clients import Proxy
from harness.agent_model import cached_model
from harness.servers import kvserve_server, server_env
from mlx_kvserve.launch.clients import CLIENTS as LAUNCHED

TASK = "How does a cache hit restored from the SSD end up in the request's cache? Look through the code."
# The scripted tool calls, one per turn, run in the copy of the repository: (the text before it, tool, input).
# File paths are made absolute at run time ({root}).
SCRIPT = [
    (
        "Listing the package.",
        "Bash",
        {"command": "ls mlx_kvserve mlx_kvserve/kv mlx_kvserve/kv/ssd mlx_kvserve/engine mlx_kvserve/engine/batch"},
    ),
    ("Reading how a hit fills the cache.", "Read", {"file_path": "{root}/mlx_kvserve/kv/cache_fill.py"}),
    ("Where runs are made and settled.", "Bash", {"command": "grep -n 'def \\|class ' mlx_kvserve/kv/runs.py"}),
    ("Reading the runs module.", "Read", {"file_path": "{root}/mlx_kvserve/kv/runs.py"}),
    ("The design notes on a hit.", "Bash", {"command": "grep -n -A40 'How a hit is assembled' docs/architecture.md"}),
    ("The buffers a direct read fills.", "Read", {"file_path": "{root}/mlx_kvserve/kv/base.py"}),
    ("Sizes of the cache modules.", "Bash", {"command": "wc -l mlx_kvserve/kv/*.py mlx_kvserve/kv/ssd/*.py"}),
    (
        "How the scheduler admits a request.",
        "Read",
        {"file_path": "{root}/mlx_kvserve/engine/batch/scheduler.py", "offset": 1, "limit": 300},
    ),
    ("The tier's read path.", "Read", {"file_path": "{root}/mlx_kvserve/kv/ssd/tier.py"}),
]
ANSWER = "The SSD tier reads the chain's block files straight into buffers the request then uses as its cache."


def tool_results(body: dict) -> int:
    return sum(
        1
        for m in body.get("messages", [])
        if m.get("role") == "user" and isinstance(m.get("content"), list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    )


def events(model: str, text: str, tool: tuple[str, dict] | None, turn: int) -> bytes:
    """A streamed Anthropic reply: `text`, then the tool call when given."""
    start = {"id": f"msg_rec{turn:02d}", "type": "message", "role": "assistant", "model": model, "content": []}
    start.update(stop_reason=None, stop_sequence=None, usage={"input_tokens": 1, "output_tokens": 1})
    out = [("message_start", {"message": start})]
    out += [("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})]
    out += [("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})]
    out += [("content_block_stop", {"index": 0})]
    if tool:
        use = {"type": "tool_use", "id": f"toolu_rec{turn:02d}", "name": tool[0], "input": {}}
        out += [("content_block_start", {"index": 1, "content_block": use})]
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool[1])}
        out += [("content_block_delta", {"index": 1, "delta": delta}), ("content_block_stop", {"index": 1})]
    stop = {"stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None}
    out += [("message_delta", {"delta": stop, "usage": {"output_tokens": 8}}), ("message_stop", {})]
    return b"".join(f"event: {k}\ndata: {json.dumps({'type': k, **v})}\n\n".encode() for k, v in out)


def scripted(root: Path):
    """The proxy's `answer`: the next scripted step for a main request (one offering Bash), else None."""

    def answer(path: str, raw: bytes) -> tuple[str, bytes] | None:
        if not path.startswith("/v1/messages") or "count_tokens" in path or not raw:
            return None
        body = json.loads(raw)
        if not any(t.get("name") == "Bash" for t in body.get("tools") or []):
            return None
        step = tool_results(body)
        if step >= len(SCRIPT):
            return "text/event-stream", events(body.get("model", "default"), ANSWER, None, step)
        text, name, arguments = SCRIPT[step]
        arguments = {k: v.format(root=root) if isinstance(v, str) else v for k, v in arguments.items()}
        return "text/event-stream", events(body.get("model", "default"), text, (name, arguments), step)

    return answer


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="the server's model (default: agent_model.py's, built once)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for Claude Code's run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "claude-recording")


def run(args: argparse.Namespace) -> int:
    if not shutil.which(LAUNCHED["claude"].program):
        print(f"Claude Code is not installed: {LAUNCHED['claude'].install}", flush=True)
        return 2
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    work = out / "repo"  # the files Claude Code reads: this repository's tracked files
    work.mkdir(parents=True)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, work / name)
    env = server_env()
    for name in [k for k in env if k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE"))]:
        del env[name]  # a user's own keys and endpoints never reach the run
    server = kvserve_server(args.model or cached_model(131072), env, out / "server-home")
    try:
        server.wait("/health", timeout=600)
        proxy = Proxy(server.url, out / "requests", scripted(work))
        env = dict(env, HOME=str(out / "home"), MLX_KVSERVE_HOME=str(out / "kvserve-home"), NO_COLOR="1")
        (out / "home").mkdir()
        launch = [sys.executable, "-m", "mlx_kvserve", "launch", "claude", "--url", proxy.url, "--"]
        cmd = [*launch, "-p", TASK, "--allowedTools", "Bash,Read"]
        print(f"server {server.url}, proxy {proxy.url}; Claude Code in {work}", flush=True)
        with open(out / "claude.out", "w") as f:
            rc = subprocess.run(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
        proxy.server.shutdown()
    finally:
        server.stop()
    main = [
        e
        for e in proxy.exchanges
        if e.body and any(t.get("name") == "Bash" for t in json.loads(e.body).get("tools") or [])
    ]
    results = [tool_results(json.loads(e.body)) for e in main]
    print(
        f"Claude Code exit {rc.returncode}; {len(proxy.exchanges)} requests, {len(main)} main ones "
        f"(tool results {results}); bodies in {out / 'requests'}",
        flush=True,
    )
    return 0 if rc.returncode == 0 and results and results[-1] == len(SCRIPT) else 1
