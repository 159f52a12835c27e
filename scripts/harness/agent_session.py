"""A recorded Claude Code session replayed on several servers, one after the other, in one run (issues 24, 44).

The session: its main requests as `agents.py record` kept them (`--session DIR`: the run's requests/), each sent
as Claude Code sent it but for the reply (streamed, greedy, 16 tokens):

- mlx-kvserve through `POST /v1/messages` (cached tokens: usage.cache_read_input_tokens), and again, fresh,
  through `POST /v1/chat/completions` with the chat form of the same conversation (as mlx_lm.server gets it);
- vllm-mlx (a scratch venv, `--vllm-mlx`) through its `POST /v1/messages`, same bodies, then fresh over chat;
- mlx_lm.server through `POST /v1/chat/completions`: the same conversation as chat messages (a leading
  Anthropic billing line, which `mlx-kvserve launch claude` turns off, is left out of the chat form).

One server runs at a time (`--ours-config`: a config file for both of ours), on the same model folder (the
random-weight long-context llama of harness/agent_model.py by default: its compute is negligible, so what shows
is each server's own cost), warmed up with a short unrelated request first. Per turn: prompt tokens, then per
server cached tokens and TTFT (request to the first streamed content delta; the end of the stream when none came).
Earlier sessions (a recorded system prompt with scripted turns, a synthetic 25k-token shape) retired to git
history with their figures in docs/benchmarks-history-2026-12-07.md.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/agents.py session --session DIR \\
        --vllm-mlx /tmp/bench-venvs/vllm-mlx/bin/vllm-mlx [--model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from harness import OURS, ROOT, VLLM
from harness import THEIRS as MLX_LM
from harness.agent_model import cached_model
from harness.clients import stream_turn
from harness.reports import write_report
from harness.servers import Server, free_port, server_env, vllm_mlx_server

OURS_CHAT, VLLM_CHAT = f"{OURS} (chat)", f"{VLLM} (chat)"  # again, over /v1/chat/completions
BASE, BASE_CHAT = f"{OURS} (baseline)", f"{OURS} (baseline, chat)"  # ours from another source tree
CHAT_SERVERS = (MLX_LM, OURS_CHAT, BASE_CHAT, VLLM_CHAT)
OUR_SERVERS = (OURS, OURS_CHAT, BASE, BASE_CHAT)
MAX_TOKENS = 16


class Turn(NamedTuple):
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int | None  # None: the server did not say


# -- the session -------------------------------------------------------------------------------------


def text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "".join(b["text"] for b in content if b["type"] == "text")


def as_chat(body: dict) -> tuple[list[dict], list[dict]]:
    """(chat messages, OpenAI tools) of a /v1/messages body, less a leading billing line (a chat client
    sends none; its per-request nonce at the prompt's start would leave no server anything to reuse)."""
    blocks = [body["system"]] if isinstance(body["system"], str) else [b["text"] for b in body["system"]]
    billed = bool(blocks) and blocks[0].startswith("x-anthropic-billing-header")
    messages = [{"role": "system", "content": "".join(blocks[1:] if billed else blocks)}]
    for m in body["messages"]:
        if isinstance(m["content"], str):
            messages.append({"role": m["role"], "content": m["content"]})
            continue
        texts = text_of(m["content"])
        uses = [b for b in m["content"] if b["type"] == "tool_use"]
        for r in (b for b in m["content"] if b["type"] == "tool_result"):
            messages.append({"role": "tool", "tool_call_id": r["tool_use_id"], "content": text_of(r["content"])})
        if uses:
            functions = [{"name": u["name"], "arguments": json.dumps(u["input"])} for u in uses]
            calls = [{"id": u["id"], "type": "function", "function": f} for u, f in zip(uses, functions, strict=True)]
            messages.append({"role": "assistant", "content": texts, "tool_calls": calls})
        elif texts:
            messages.append({"role": m["role"], "content": texts})
    functions = [
        {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]} for t in body["tools"]
    ]
    tools = [{"type": "function", "function": f} for f in functions]
    return messages, tools


def recorded_session(folder: Path) -> list[dict]:
    """The main requests (those offering Bash) of a session `agents.py record` kept in `folder`, in order, each
    as it was sent but for the reply: streamed, greedy, MAX_TOKENS."""
    bodies = [json.loads(p.read_text()) for p in sorted(folder.glob("*-POST_v1_messages*.json")) if p.stat().st_size]
    main = [b for b in bodies if any(t.get("name") == "Bash" for t in b.get("tools") or [])]
    return [dict(b, model="default", max_tokens=MAX_TOKENS, temperature=0.0, stream=True) for b in main]


# -- clients -----------------------------------------------------------------------------------------


def stream_messages(url: str, body: dict) -> Turn:
    """One streamed /v1/messages request; TTFT to the first content_block_delta."""
    start, ttft, usage = time.perf_counter(), None, {}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=900, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}/v1/messages -> {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - start
            found = (event.get("message") or {}).get("usage") or event.get("usage") or {}
            usage.update({k: v for k, v in found.items() if v is not None})
    ttft = ttft if ttft is not None else time.perf_counter() - start
    cached = usage.get("cache_read_input_tokens")
    prompt = usage.get("input_tokens", 0) + (cached or 0) + (usage.get("cache_creation_input_tokens") or 0)
    return Turn(ttft, prompt, cached)


def chat_turn(server: Server, body: dict) -> Turn:
    messages, tools = as_chat(body)
    reply = stream_turn(server, messages, tools, MAX_TOKENS)  # greedy, usage in the last chunk
    return Turn(reply.ttft_s, reply.prompt_tokens, reply.cached_tokens)


VLLM_FETCH = re.compile(r"\[cache_fetch\] request=\S+ (HIT|MISS) prompt_tokens=(\d+)(?: cached=(\d+))?")


def vllm_logged(turn: Turn, log: Path, start: int) -> Turn:
    """`turn` with vllm-mlx's prompt and cached tokens from its log (its stream reports input_tokens 0
    and no cache_read_input_tokens): the `[cache_fetch]` line the request wrote after byte `start`."""
    with open(log, "rb") as f:
        f.seek(start)
        found = VLLM_FETCH.findall(f.read().decode(errors="replace"))
    if not found:
        return turn
    _, prompt, cached = found[-1]
    return Turn(turn.ttft_s, int(prompt), int(cached or 0))


def warm_up(server: Server) -> None:
    """A short unrelated request: first-use kernel compilation, not part of the session."""
    body = {"model": "default", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if server.name in CHAT_SERVERS:
        stream_turn(server, body["messages"], [], 2)
    else:
        stream_messages(server.url, body)


# -- servers -----------------------------------------------------------------------------------------


def start(name: str, args: argparse.Namespace, work: Path) -> Server:
    port, env, model = free_port(), server_env(), args.model
    if name in OUR_SERVERS:
        env["MLX_KVSERVE_HOME"] = str(work / f"kvserve-home-{OUR_SERVERS.index(name)}")  # each its own cold cache
        if name in (BASE, BASE_CHAT):  # the baseline's package first on the path (not the working directory's)
            env.update(PYTHONPATH=str(args.baseline), PYTHONSAFEPATH="1")
        cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model), "--port", str(port)]
        cmd += ["--config", str(args.ours_config)] if args.ours_config else []
        server = Server(name, cmd, port, env, "/health")
    elif name in (VLLM, VLLM_CHAT):  # a fresh HOME each (it reloads its saved prefix cache): turn 1 cold
        server = vllm_mlx_server(args.vllm_mlx, model, work / f"vllm-home-{name == VLLM_CHAT}", env)
        cmd = server.cmd
    else:
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)]
        server = Server(name, cmd, port, env, "/v1/models")
    print(f"{name}: {' '.join(cmd)} (log {server.log.name})", flush=True)
    server.wait(server.ready_path, timeout=600)
    warm_up(server)
    return server


def run_server(name: str, bodies: list[dict], args: argparse.Namespace, work: Path) -> dict:
    """The session (its /v1/messages bodies) on one server: {"turns": [Turn as dict]} or {"error": why it could
    not run}."""
    try:
        server = start(name, args, work)
    except Exception as exc:  # reported in the table: a peer that cannot start here
        return {"error": f"{type(exc).__name__}: {exc}"}
    rows = []
    try:
        for turn, body in enumerate(bodies):
            log_start = Path(server.log.name).stat().st_size
            result = chat_turn(server, body) if name in CHAT_SERVERS else stream_messages(server.url, body)
            if server.name == VLLM:  # both routes (its Server's name is VLLM: the model named in each body)
                result = vllm_logged(result, Path(server.log.name), log_start)
            rows.append(result._asdict())
            print(
                f"  {name} turn {turn + 1}: {result.prompt_tokens} tokens, cached {result.cached_tokens}, "
                f"TTFT {result.ttft_s:.2f} s",
                flush=True,
            )
    except Exception as exc:
        return {"turns": rows, "error": f"{type(exc).__name__}: {exc} (log {server.log.name})"}
    finally:
        server.stop()
    return {"turns": rows, "log": server.log.name}


# -- report ------------------------------------------------------------------------------------------


def median_run(runs: list[dict]) -> dict:
    """One server's rounds as one: per turn the median TTFT (tokens from the first round); errors kept."""
    done = [r for r in runs if r.get("turns") and len(r["turns"]) == len(runs[0].get("turns", []))]
    merged = dict(runs[0])
    if done:
        merged["turns"] = [
            dict(turn, ttft_s=statistics.median(r["turns"][i]["ttft_s"] for r in done))
            for i, turn in enumerate(done[0]["turns"])
        ]
    errors = [r["error"] for r in runs if r.get("error")]
    if errors:
        merged["error"] = "; ".join(errors)
    return merged


def cold_ttft(result: dict) -> float | None:
    turns = result.get("turns", [])
    return turns[0]["ttft_s"] if turns else None


def later_mean(result: dict) -> float | None:
    ttfts = [t["ttft_s"] for t in result.get("turns", [])[1:]]
    return statistics.mean(ttfts) if ttfts else None


def report_lines(results: dict) -> list[str]:
    names = [n for n in results["servers"] if results["servers"][n].get("turns")]
    lines = [
        f"Shape: {results['source']}; {results['num_tools']} tools; {results['turns']} turns; {MAX_TOKENS} tokens "
        f"per reply, greedy; TTFT the median of {len(results.get('rounds', [1]))} rounds, servers rotated; "
        f"each request as recorded. Wall time "
        f"{results['wall_s'] / 60:.1f} min. Prompt tokens per server in column order where they differ.",
        "",
        "| turn | prompt tokens | " + " | ".join(f"{n} cached | {n} TTFT s" for n in names) + " |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for i in range(results["turns"]):
        cells, prompts = [], []
        for n in names:
            rows = results["servers"][n]["turns"]
            if i < len(rows):
                r = rows[i]
                prompts.append(f"{r['prompt_tokens']}")
                cells.append(f"{'-' if r['cached_tokens'] is None else r['cached_tokens']} | {r['ttft_s']:.2f}")
            else:
                cells.append("- | -")
        shown = prompts[0] if len(set(prompts)) <= 1 else " / ".join(prompts)
        lines.append(f"| {i + 1} | {shown} | " + " | ".join(cells) + " |")
    theirs = results["servers"].get(MLX_LM, {})
    base_later, base_cold = later_mean(theirs), cold_ttft(theirs)
    lines.append("")
    for n in names:
        mean, cold = later_mean(results["servers"][n]), cold_ttft(results["servers"][n])
        ratio = f" ({mean / base_later:.2f}x {MLX_LM})" if base_later and mean and n != MLX_LM else ""
        cold_ratio = f" ({cold / base_cold:.2f}x)" if base_cold and cold and n != MLX_LM else ""
        lines.append(
            f"- {n}: turns 2-{results['turns']} mean TTFT {mean:.2f} s{ratio}; turn 1 {cold:.2f} s{cold_ratio}"
        )
    for n, r in results["servers"].items():
        if r.get("error"):
            lines.append(f"- {n}: {r['error']}")
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="model folder (default: agent_model.py's recipe, built if needed)")
    parser.add_argument("--layers", type=int, default=1, help="layers of the built model")
    parser.add_argument("--heads", type=int, default=1, help="attention heads of the built model (64 dimensions each)")
    parser.add_argument("--vllm-mlx", help="the vllm-mlx executable of a scratch venv (left out: not run)")
    parser.add_argument("--rounds", type=int, default=1, help="sessions per server, in rotation; medians")
    parser.add_argument("--ours-config", type=Path, help="a config file for both of our servers")
    parser.add_argument("--baseline", type=Path, help="another source tree of ours (`git archive` of a commit)")
    parser.add_argument(
        "--session", type=Path, help="a recorded session to replay as it was (`agents.py record`'s requests/)"
    )
    parser.add_argument("--no-chat", action="store_true", help="ours over /v1/messages only")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "claude_session")


def run(args: argparse.Namespace) -> None:
    if args.model is None:
        args.model = cached_model(131072, args.layers, args.heads)
    recorded = recorded_session(args.session)
    if not recorded:
        raise SystemExit(f"{args.session}: no Claude Code request offering Bash (run `agents.py record` first)")
    pairs = [(OURS, OURS_CHAT)] + [(BASE, BASE_CHAT)] * bool(args.baseline) + [(VLLM, VLLM_CHAT)] * bool(args.vllm_mlx)
    names = [n for pair in pairs for n in pair[: 1 if args.no_chat else 2]] + [MLX_LM]
    work, start_s = Path(tempfile.mkdtemp(prefix="kvserve-claude-session-")), time.perf_counter()
    results: dict = {
        "source": str(args.session),
        "num_tools": len(recorded[0]["tools"]),
        "turns": len(recorded),
        "model": str(args.model),
        "servers": {},
    }
    rounds = []
    for r in range(args.rounds):  # each round in another order, on fresh homes (turn 1 cold again)
        order = names[r % len(names) :] + names[: r % len(names)]
        (work / f"round-{r}").mkdir()
        rounds.append({name: run_server(name, recorded, args, work / f"round-{r}") for name in order})
    results["rounds"] = rounds
    results["servers"] = {name: median_run([found[name] for found in rounds]) for name in names}
    results["wall_s"] = time.perf_counter() - start_s
    write_report(results, args.out, report_lines(results))
