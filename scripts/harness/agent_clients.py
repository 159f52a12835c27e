"""The real agent clients, two turns each, against `mlx-kvserve run` (issues 24 and 47): Claude Code, Codex,
opencode, Qwen Code, Cline, aider and llm through `mlx-kvserve launch CLIENT --url`, the OpenAI Agents SDK,
LangChain and LiteLLM with docs/agent-clients.md's settings. The model is harness/agent_model.py's (random weights,
a long context, SmolLM2's tokenizer, replies of a few tokens: gibberish answers, the protocol is what is tested),
behind a proxy that keeps each request. A client not installed (on --bin, this Python's bin or PATH; the SDKs in
--python) is named with its install command. Per client: works, its first failure, the second turn's cached tokens;
`--record` saves each client version's requests (long text cut) under tests/data/client_requests/, which
tests/server/test_client_requests.py replays. Exit status 1 when a client fails, 2 when none asked is installed.

    scripts/agents.py clients [--clients claude,llm] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from harness import ROOT
from harness.agent_model import cached_model
from harness.reports import version, write_report
from harness.servers import Server, kvserve_server, server_env
from mlx_kvserve.launch.clients import CLIENTS as LAUNCHED

DATA = ROOT / "tests" / "data" / "client_requests"
MAX_TEXT = 300  # characters kept of a long string in a recording
DEVICE_ID = re.compile(r'(\\?"device_id\\?":\s*\\?")[0-9a-f]+')  # Claude Code's per-machine id, in metadata
AIDER = ["--yes", "--no-git", "--no-check-update", "--no-analytics", "--no-pretty", "--no-stream"]
LAUNCH_TURNS = {  # each launched client's two turns: its arguments after `mlx-kvserve launch CLIENT --`
    "claude": [["-p", "say hi"], ["-c", "-p", "again"]],
    "codex": [["exec", "say hi"], ["exec", "resume", "--last", "again"]],
    "opencode": [["run", "say hi"], ["run", "-c", "again"]],
    "qwen": [["-p", "say hi"], ["--continue", "-p", "again"]],
    "cline": [["say hi"], ["say it again"]],  # a second task (one word would be read as a command)
    "aider": [[*AIDER, "--message", "say hi"], [*AIDER, "--restore-chat-history", "--message", "again"]],
    "llm": [["say hi"], ["-c", "again"]],
}
SDKS = {"agents": "openai-agents", "langchain": "langchain-openai", "litellm": "litellm"}  # client: its package
SDK_MODULES = {"agents": "agents", "langchain": "langchain_openai", "litellm": "litellm"}
RECORDED_NAMES = {"claude": "claude-code", "qwen": "qwen-code", **SDKS}  # the recordings' file names
WEATHER = (  # the SDK runs' one tool, in each SDK's own way
    "def get_weather(city: str) -> str:\n    '''The weather in a city.'''\n    return 'sunny'\n"
    "schema = {'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city.',\n"
    "    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}\n"
)
SDK_SCRIPTS = {  # each run as `python -c SCRIPT BASE_URL TURN`: argv[1] the server's /v1, argv[2] "1" or "2"
    "agents": """import sys
from openai import AsyncOpenAI
from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1], api_key="unused"), use_for_tracing=False)
agent = Agent(name="helper", instructions="You are a helpful assistant.", model="default",
              tools=[function_tool(get_weather)])
first = Runner.run_sync(agent, "say hi")
second = Runner.run_sync(agent, first.to_input_list() + [{"role": "user", "content": "again"}])
print(repr(first.final_output), repr(second.final_output))""",
    "langchain": """import sys
from typing import Literal
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
class Person(BaseModel):
    name: Literal["Alice", "Bob"]  # a random model fills a free string until max_tokens
    age: int
llm = ChatOpenAI(base_url=sys.argv[1], api_key="unused", model="default", max_tokens=256, timeout=600)
tools, history = llm.bind_tools([schema]), [HumanMessage("say hi")]
first = tools.invoke(history)
if sys.argv[2] == "1":
    print(repr(first.content), first.tool_calls, llm.with_structured_output(Person).invoke("Alice is 30."))
else:
    print(repr(tools.invoke(history + [AIMessage(first.content or "hi"), HumanMessage("again")]).content))""",
    "litellm": """import sys
import litellm
history = [{"role": "user", "content": "say hi"}]
ask = dict(model="openai/default", api_base=sys.argv[1], api_key="unused", tools=[schema], max_tokens=64)
first = litellm.completion(messages=history, **ask).choices[0].message.content or "hi"
history += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
print(repr(first), repr("".join(c.choices[0].delta.content or "" for c in litellm.completion(
    messages=history, stream=True, **ask))))""",
}
SDK_TURNS = {"agents": ["1"], "langchain": ["1", "2"], "litellm": ["1"]}


def shrink(value: Any, key: str = "") -> Any:
    """`value` with every string longer than MAX_TEXT cut to it (not under `arguments`: JSON a client parses)."""
    if isinstance(value, dict):
        return {k: shrink(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [shrink(v, key) for v in value]
    if isinstance(value, str):
        value = DEVICE_ID.sub(lambda m: m.group(1) + "0" * 16, value)
        if len(value) > MAX_TEXT and key != "arguments":
            return value[:MAX_TEXT] + " [cut]"
    return value


def recording(client: str, version: str, requests: list[tuple[str, str, bytes]], how: str = "") -> dict[str, Any]:
    """A client version's (method, path, body) requests, every field kept, long text cut. `how`: a second
    recording of the same version run another way (e.g. "interactive"), saved beside the first."""
    items = [{"method": m, "path": p, **({"body": shrink(json.loads(b))} if b else {})} for m, p, b in requests]
    return {"client": client, "version": version, "how": how, "requests": items}


def save(rec: dict[str, Any], folder: Path = DATA) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{rec['client']}-{rec['version']}{'-' + rec['how'] if rec.get('how') else ''}.json"
    path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return path


def load_all(folder: Path = DATA) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


class Exchange(NamedTuple):
    method: str
    path: str
    body: bytes
    status: int
    error: str  # the response body of a status >= 400, else ""


class Proxy:
    """Forwards each request to `upstream`, keeps an Exchange for it and saves its body under `folder` (what
    `agents.py session --session` replays of a run of `agents.py record`). A response is passed on whole once the server has sent it:
    a client reads a streamed reply that arrives at once just the same. `answer(path, body)`, when given, may answer
    a request itself instead: (content type, reply body), or None to forward it."""

    def __init__(self, upstream: str, folder: Path, answer: Callable[[str, bytes], tuple[str, bytes] | None] = None):
        self.upstream, self.folder, self.exchanges, self.answer = upstream, folder, [], answer
        folder.mkdir(parents=True)
        self.lock = threading.Lock()  # guards exchanges
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy, skip = self, {"host", "connection", "content-length", "transfer-encoding", "content-encoding"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                url, own = proxy.upstream + self.path, proxy.answer and proxy.answer(self.path, body)
                if own:
                    reply = httpx.Response(200, headers={"content-type": own[0]}, content=own[1])
                else:
                    reply = httpx.request(self.command, url, content=body or None, headers=headers, timeout=900)
                error = reply.text[:2000] if reply.status_code >= 400 else ""
                with proxy.lock:
                    proxy.exchanges.append(Exchange(self.command, self.path, body, reply.status_code, error))
                    name = f"{len(proxy.exchanges):03d}-{self.command}{self.path.split('?')[0].replace('/', '_')}.json"
                (proxy.folder / name).write_bytes(body)
                self.send_response(reply.status_code)
                for key, value in reply.headers.items():
                    if key.lower() not in skip:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = forward

        return Handler


def missing(client: str, path: str, python: str) -> str:
    """How to install `client` when it is not installed, else ""."""
    if client in SDKS:
        found = subprocess.run([python, "-c", f"import {SDK_MODULES[client]}"], capture_output=True).returncode == 0
        return "" if found else f"{python} -m pip install {SDKS[client]}"
    return "" if shutil.which(LAUNCHED[client].program, path=path) else LAUNCHED[client].install


def client_version(client: str, env: dict[str, str], python: str) -> str:
    """The client's version as its --version prints it, or its SDK package's ("" when it cannot say)."""
    if client in SDKS:
        cmd = [python, "-c", f"import importlib.metadata as m; print(m.version({SDKS[client]!r}))"]
    else:
        cmd = [shutil.which(LAUNCHED[client].program, path=env["PATH"]) or client, "--version"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r"\d+\.\d+(\.\d+)?", out)
    return found.group(0) if found else ""


def turn_commands(client: str, url: str, python: str) -> list[list[str]]:
    if client in SDKS:
        return [[python, "-c", WEATHER + SDK_SCRIPTS[client], f"{url}/v1", turn] for turn in SDK_TURNS[client]]
    launch = [sys.executable, "-m", "mlx_kvserve", "launch", client, "--url", url, "--"]
    return [[*launch, *args] for args in LAUNCH_TURNS[client]]


class Result(NamedTuple):
    client: str
    works: bool
    failure: str  # a completion request the server refused, or the client's exit, or ""
    turn1_prompt: int  # turn_tokens'
    turn2_prompt: int
    turn2_cached: int
    requests: int


def turn_tokens(done: list[dict]) -> tuple[int, int, int]:
    """(turn 1's prompt, turn 2's prompt and cached tokens) of a client's finished requests: turn 2 is the last
    request of a main size (not a small background call), turn 1 the largest before it; zeros when none."""
    biggest = max((r["prompt_tokens"] for r in done), default=0)
    at = max((i for i, r in enumerate(done) if r["prompt_tokens"] >= biggest // 2), default=-1)
    before = max(done[:at], key=lambda r: r["prompt_tokens"], default=None) if at > 0 else None
    return (before["prompt_tokens"], done[at]["prompt_tokens"], done[at]["cached_tokens"]) if before else (0, 0, 0)


def run_client(client: str, env: dict[str, str], server: Server, proxy: Proxy, args: argparse.Namespace) -> Result:
    folder = args.run_dir / client
    (folder / "home").mkdir(parents=True)
    # A private HOME and mlx-kvserve home: the launched client's profile and history start empty.
    env = dict(env, HOME=str(folder / "home"), MLX_KVSERVE_HOME=str(folder / "kvserve-home"), NO_COLOR="1")
    seen = {r["id"] for r in httpx.get(server.url + "/v1/cache/requests").json()["requests"]}
    first_exchange, failure = len(proxy.exchanges), ""
    for turn, cmd in enumerate(turn_commands(client, proxy.url, args.python), 1):
        out = folder / f"turn{turn}.out"
        with open(out, "w") as f:
            try:
                rc = subprocess.run(cmd, cwd=folder, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
        rc = getattr(rc, "returncode", rc)
        tail = out.read_text(errors="replace").strip().splitlines()[-6:]
        print(f"  {client} turn {turn}: exit {rc}\n    " + "\n    ".join(tail), flush=True)
        if rc != 0 and not failure:
            failure = f"turn {turn} exit {rc}: {tail[-1] if tail else ''} (output: {out})"
    exchanges = proxy.exchanges[first_exchange:]
    refused = [e for e in exchanges if e.status >= 400 and e.method == "POST"]  # a refused GET a client gets past
    if refused:
        failure = f"{refused[0].path} -> {refused[0].status}: {refused[0].error[:300]} (bodies in {proxy.folder})"
    if args.record and (found := client_version(client, env, args.python)):
        rec = recording(RECORDED_NAMES.get(client, client), found, [(e.method, e.path, e.body) for e in exchanges])
        print(f"  recorded {len(exchanges)} requests in {save(rec, args.data)}", flush=True)
    done = httpx.get(server.url + "/v1/cache/requests").json()["requests"]
    done = [r for r in done if r["id"] not in seen and r["status"] == 200]
    return Result(client, not failure, failure, *turn_tokens(done), len(exchanges))


def report_lines(results: list[Result], absent: dict[str, str]) -> list[str]:
    header = "| Client | Works | First failure | Turn 2 cached / prompt | of turn 1's prompt | Requests |"
    lines = [header, "|" + "---|" * 6]
    for r in results:
        share = f" ({100 * r.turn2_cached / r.turn2_prompt:.1f}%)" if r.turn2_prompt else ""
        of_first = f"{100 * r.turn2_cached / r.turn1_prompt:.1f}%" if r.turn1_prompt else "-"
        failure = r.failure.replace("|", "\\|").replace("\n", " ") or "-"
        cached, works = f"{r.turn2_cached:,} / {r.turn2_prompt:,}{share}", "yes" if r.works else "no"
        lines.append(f"| {r.client} | {works} | {failure} | {cached} | {of_first} | {r.requests} |")
    return lines + [f"- {client}: not installed; install it with `{hint}`" for client, hint in absent.items()]


def add_args(parser: argparse.ArgumentParser) -> None:
    names = ",".join([*LAUNCH_TURNS, *SDKS])
    parser.add_argument("--clients", default=names, help=f"comma-separated, of {names} (default: all)")
    parser.add_argument("--bin", action="append", default=[], help="a folder searched for the clients before PATH")
    parser.add_argument("--python", default=sys.executable, help="the Python that has the SDKs")
    parser.add_argument("--model", type=Path, help="a model folder (default: agent_model.py's recipe, built once)")
    parser.add_argument("--context", type=int, default=131072, help="the built model's context in tokens")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per client turn")
    parser.add_argument("--record", action="store_true", help="save the requests under --data")
    parser.add_argument("--data", type=Path, default=DATA, help="where --record saves (default: the tests' data)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "clients")


def run(args: argparse.Namespace) -> int:
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = [c for c in clients if c not in LAUNCH_TURNS and c not in SDKS]
    if unknown:
        raise SystemExit(f"unknown client(s) {', '.join(unknown)}: choose from {', '.join([*LAUNCH_TURNS, *SDKS])}")
    env = server_env()
    # --bin first, then this Python's own bin folder (where `pip install llm` puts llm), then PATH
    env["PATH"] = os.pathsep.join([*map(str, args.bin), str(Path(sys.executable).parent), env.get("PATH", "")])
    for name in [k for k in env if k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE"))]:
        del env[name]  # a user's own keys and endpoints never reach a client run here
    absent = {c: hint for c in clients if (hint := missing(c, env["PATH"], args.python))}
    for client, hint in absent.items():
        print(f"{client}: not installed; install it with: {hint}", flush=True)
    clients = [c for c in clients if c not in absent]
    if not clients:
        return 2
    model = args.model or cached_model(args.context)
    args.run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    server = kvserve_server(model, env, args.run_dir / "server-home")
    results = []
    try:
        server.wait("/health", timeout=600)
        proxy = Proxy(server.url, args.run_dir / "requests")
        print(f"server {server.url} (log {server.log.name}), proxy {proxy.url}, output in {args.run_dir}", flush=True)
        for client in clients:
            print(f"{client}:", flush=True)
            results.append(run_client(client, env, server, proxy, args))
        proxy.server.shutdown()
    finally:
        server.stop()
    summary = {"model": str(model), "mlx_kvserve": version("mlx-kvserve"), "not_installed": absent}
    write_report({**summary, "results": [r._asdict() for r in results]}, args.run_dir, report_lines(results, absent))
    return 0 if all(r.works for r in results) else 1
