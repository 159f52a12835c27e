"""An agent conversation, mlx-kvserve vs mlx_lm.server over the OpenAI API, in one run (issue 13).

SmolLM2 on the CPU, given a Qwen-style tool template (scripts/harness/agent_workload.py) through `[model]
chat_template` for ours and `--chat-template` for mlx_lm.server, so both render the same prompts. The
system turn, agent instructions plus 20 tool schemas, is ~6k tokens (SmolLM2's context is 8k, so the
instructions take ~3.9k and the schemas ~2.1k). 10 turns: each appends the previous assistant turn (a
scripted text reply, or a scripted tool call and its result) and a new user message; streamed, greedy,
16 tokens per reply, the tools sent with every request. The two servers take turns, request by request.
Two conversations, each on its own system prompt (so its first turn is cold on both servers):
- no restart: turns 1-10;
- restart: turns 1-5, both servers restarted (ours on the same cache folder: its SSD tier; mlx_lm.server
  starts empty) and warmed up with a short unrelated chat (first-use kernel compilation), turns 6-10.
Per turn: TTFT (request to the first streamed delta) and cached tokens (usage.prompt_tokens_details).
Cold reference of a turn: our cold TTFT at that turn's prompt length, interpolated linearly between two
measured cold requests: the conversation's own turn 1, and turn 10's messages under a fresh system
prompt (measured last). Linear in tokens slightly underestimates the cost of a longer cold prompt.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_agent.py [--quick] [--out DIR]

Targets: every turn after the first at least 5x faster than cold and at least 2x faster than
mlx_lm.server, per turn and over the run (sums of TTFT over turns 2-10).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from harness import OURS, ROOT, THEIRS, default_model_dir
from harness.agent_summary import FULL, QUICK, Params, report_lines
from harness.agent_workload import TOOL_TEMPLATE, agent_instructions, count_tokens, tool_schemas, turn_messages
from harness.clients import stream_turn
from harness.reports import write_report
from harness.servers import Server, free_port, server_env


def warm_up(server: Server) -> None:
    stream_turn(server, [{"role": "user", "content": "warm up"}], [], 2)  # first-use kernel compilation


def start_pair(model_dir: Path, work: Path) -> list[Server]:
    """Ours (its own home, the tool template by `[model] chat_template`) and mlx_lm.server (the same
    template by `--chat-template`), ready and warmed up."""
    template = work / "tool_template.jinja"
    template.write_text(TOOL_TEMPLATE)
    config = work / "config.toml"
    config.write_text(f"[model]\nchat_template = {json.dumps(str(template))}\n")
    env = server_env()
    ours_port, theirs_port = free_port(), free_port()
    ours_cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model_dir), "--port", str(ours_port)]
    theirs_cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(theirs_port)]
    servers = [
        Server(OURS, [*ours_cmd, "--config", str(config)], ours_port, dict(env, MLX_KVSERVE_HOME=str(work)), "/health"),
        Server(THEIRS, [*theirs_cmd, "--chat-template", TOOL_TEMPLATE], theirs_port, env, "/v1/models"),
    ]
    try:
        for server in servers:
            server.wait(server.ready_path)
            warm_up(server)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def run_conversation(servers: list[Server], p: Params, nonce: str, restart_after: int | None) -> list[dict]:
    """One conversation on every server, turn by turn (the servers take turns); both restarted before
    turn `restart_after` + 1 when given. Returns per turn {server name: TurnReply as a dict}."""
    system, tools = agent_instructions(nonce, p.instruction_words), tool_schemas(p.num_tools)
    turns = []
    for turn in range(p.turns):
        if turn == restart_after:
            for server in servers:
                server.restart()  # ours drains its SSD writes on SIGTERM; the same home on start
                warm_up(server)
        row = {s.name: stream_turn(s, turn_messages(system, turn), tools, p.max_tokens)._asdict() for s in servers}
        turns.append(row)
        print(
            f"{nonce} turn {turn + 1}: "
            + ", ".join(f"{n} {r['ttft_s']:.2f}s/{r['cached_tokens']}" for n, r in row.items()),
            flush=True,
        )
    return turns


def run(p: Params, model_dir: Path) -> dict:
    """Both servers, both conversations, then the full-length cold request; the results as JSON data."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvserve-agent-"))
    stamp = f"{time.time():.0f}"
    system = [{"role": "system", "content": agent_instructions(f"a{stamp}", p.instruction_words)}]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    results: dict = {
        "params": p._asdict(),
        "model": model_dir.name,
        "system_tokens": count_tokens(tokenizer, system, tool_schemas(p.num_tools)),
        "conversations": {},
    }
    servers = start_pair(model_dir, work)
    try:
        results["conversations"]["no restart"] = {"turns": run_conversation(servers, p, f"a{stamp}", None)}
        results["conversations"][f"restart after turn {p.restart_after}"] = {
            "turns": run_conversation(servers, p, f"b{stamp}", p.restart_after)
        }
        full = stream_turn(
            servers[0],
            turn_messages(agent_instructions(f"c{stamp}", p.instruction_words), p.turns - 1),
            tool_schemas(p.num_tools),
            p.max_tokens,
        )
        results["full_cold"] = [full.prompt_tokens, full.ttft_s]
    finally:
        for server in servers:
            server.stop()
    results["wall_s"] = time.perf_counter() - start
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~1.2k-token system turn, 6 tools, 4 turns (smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "agent", help="folder for results.json, report.md")
    ap.add_argument("--model", type=Path, help="model folder (default: SmolLM2, fetched if needed)")
    args = ap.parse_args(argv)
    results = run(QUICK if args.quick else FULL, args.model or default_model_dir())
    write_report(results, args.out, report_lines(results))
    return results


if __name__ == "__main__":
    main()
