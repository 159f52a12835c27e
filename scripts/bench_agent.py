"""An agent conversation, mlx-kvserve vs mlx_lm.server over the OpenAI API, in one run (issue 13).

SmolLM2 on the CPU, given a Qwen-style tool template (scripts/agent_workload.py) through `[model]
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

    python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_agent.py [--quick] [--out DIR]

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
from typing import Any, NamedTuple

import httpx
from agent_workload import TOOL_TEMPLATE, agent_instructions, count_tokens, tool_schemas, turn_messages
from bench import OURS, THEIRS, server_env
from bench_common import ROOT, default_model_dir, write_report
from bench_prefix import Server, free_port

TARGET_COLD, TARGET_THEIRS = 5.0, 2.0


class Params(NamedTuple):
    instruction_words: int  # agent instructions; with 20 schemas the system turn is ~6k SmolLM2 tokens
    num_tools: int
    turns: int
    restart_after: int  # the restart conversation restarts both servers after this many turns
    max_tokens: int  # per reply


FULL = Params(instruction_words=2900, num_tools=20, turns=10, restart_after=5, max_tokens=16)
QUICK = Params(instruction_words=500, num_tools=6, turns=4, restart_after=2, max_tokens=8)


class Reply(NamedTuple):
    ttft_s: float  # request to the first delta with content, a tool call or reasoning
    prompt_tokens: int
    cached_tokens: int | None  # None when the server does not report them
    first: str  # what that first delta carried: "content", "tool_calls", "reasoning_content" or "none"


def stream_turn(server: Server, messages: list[dict], tools: list[dict], max_tokens: int) -> Reply:
    """One streamed greedy chat completion with `tools`, timed from the request to its first delta."""
    body: dict[str, Any] = {
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server.name == OURS:
        body["model"] = "default"
    start = time.perf_counter()
    ttft, first, usage = None, "none", {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                kind = next((k for k in ("content", "tool_calls", "reasoning_content") if delta.get(k)), None)
                if kind and ttft is None:
                    ttft, first = time.perf_counter() - start, kind
            usage = chunk.get("usage") or usage
    if ttft is None:  # nothing streamed before the end
        ttft = time.perf_counter() - start
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return Reply(ttft, usage.get("prompt_tokens", 0), cached, first)


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
    turn `restart_after` + 1 when given. Returns per turn {server name: Reply as a dict}."""
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


def cold_reference(points: list[tuple[int, float]], tokens: int) -> float:
    """Cold TTFT at `tokens` prompt tokens: the line through two measured (tokens, seconds) points
    (through the origin when both have one length)."""
    (a, ta), (b, tb) = points
    if a == b:
        return ta * tokens / a
    return ta + (tb - ta) * (tokens - a) / (b - a)


def summarize(turns: list[dict], full_cold: tuple[int, float]) -> dict:
    """Per turn: our TTFT, mlx_lm.server's, the cold reference (turn 1: itself) and the two ratios;
    over turns 2..N: the ratios of the TTFT sums; whether each target is met per turn and over the run."""
    first = turns[0][OURS]
    points = [(first["prompt_tokens"], first["ttft_s"]), full_cold]
    rows = []
    for i, row in enumerate(turns):
        ours, theirs = row[OURS], row[THEIRS]
        cold = first["ttft_s"] if i == 0 else cold_reference(points, ours["prompt_tokens"])
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": ours["prompt_tokens"],
                "same_prompt": ours["prompt_tokens"] == theirs["prompt_tokens"],
                "cached": {OURS: ours["cached_tokens"], THEIRS: theirs["cached_tokens"]},
                "ttft_s": {OURS: ours["ttft_s"], THEIRS: theirs["ttft_s"]},
                "cold_s": cold,
                "vs_cold": cold / ours["ttft_s"],
                "vs_theirs": theirs["ttft_s"] / ours["ttft_s"],
            }
        )
    later = rows[1:]
    ours_sum = sum(r["ttft_s"][OURS] for r in later)
    run = {
        "vs_cold": sum(r["cold_s"] for r in later) / ours_sum,
        "vs_theirs": sum(r["ttft_s"][THEIRS] for r in later) / ours_sum,
    }
    met = {
        "per_turn_cold": all(r["vs_cold"] >= TARGET_COLD for r in later),
        "per_turn_theirs": all(r["vs_theirs"] >= TARGET_THEIRS for r in later),
        "run_cold": run["vs_cold"] >= TARGET_COLD,
        "run_theirs": run["vs_theirs"] >= TARGET_THEIRS,
    }
    return {"rows": rows, "run": run, "met": met}


def _yes(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report_lines(results: dict) -> list[str]:
    """The markdown report: one table per conversation, then its ratios against the targets."""
    p = Params(**results["params"])
    lines = [
        f"System turn {results['system_tokens']} tokens ({p.num_tools} tool schemas), {p.turns} turns, "
        f"{p.max_tokens} tokens per reply, greedy. TTFT in seconds; cold = our cold TTFT at the turn's prompt "
        f"length, interpolated between turn 1 and a cold {results['full_cold'][0]}-token request "
        f"({results['full_cold'][1]:.2f} s). Wall time {results['wall_s'] / 60:.1f} min.",
    ]
    for name, conv in results["conversations"].items():
        s = summarize(conv["turns"], tuple(results["full_cold"]))
        lines += [
            "",
            f"**{name}**",
            "",
            "| turn | prompt tokens | cached ours / theirs | mlx-kvserve | mlx_lm.server | cold | cold / ours "
            "| theirs / ours |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            cached = " / ".join("-" if r["cached"][n] is None else str(r["cached"][n]) for n in (OURS, THEIRS))
            same = "" if r["same_prompt"] else " (prompts differ)"
            lines.append(
                f"| {r['turn']} | {r['prompt_tokens']}{same} | {cached} | {r['ttft_s'][OURS]:.2f} | "
                f"{r['ttft_s'][THEIRS]:.2f} | {r['cold_s']:.2f} | {r['vs_cold']:.1f}x | {r['vs_theirs']:.2f}x |"
            )
        later = s["rows"][1:]
        m, run = s["met"], s["run"]
        lines += [
            "",
            f"Turns 2-{p.turns}: cold / ours {min(r['vs_cold'] for r in later):.1f}x at least "
            f"(>= {TARGET_COLD:.0f}x per turn: {_yes(m['per_turn_cold'])}), {run['vs_cold']:.1f}x over the run "
            f"({_yes(m['run_cold'])}); theirs / ours {min(r['vs_theirs'] for r in later):.2f}x at least "
            f"(>= {TARGET_THEIRS:.0f}x per turn: {_yes(m['per_turn_theirs'])}), {run['vs_theirs']:.2f}x over the "
            f"run ({_yes(m['run_theirs'])}).",
        ]
    firsts = {
        r[n]["first"] for conv in results["conversations"].values() for r in conv["turns"] for n in (OURS, THEIRS)
    }
    if firsts != {"content"}:
        lines += ["", f"First deltas carried: {sorted(firsts)} (not only text)."]
    return lines


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
