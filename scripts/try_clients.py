"""Run the real agent clients against a fresh server, as a new user would (issues 24 and 47).

Installs each client into a scratch folder (npm: Claude Code, Codex CLI, opencode, Qwen Code, Cline; a
scratch venv: aider, llm, the OpenAI Agents SDK, LangChain), starts `mlx-kvserve run` on a
random-weight model with a long context and SmolLM2's tokenizer (so a ~30k-token agent prompt
prefills in well under a minute on the CPU), puts a small logging proxy in front of it, and runs
every client for two turns: the seven agent clients through `mlx-kvserve launch CLIENT --url PROXY`
(no hand-written settings), the two SDKs with the settings of docs/agent-clients.md. Per client it
prints: works / first failure (status and the server's error, the request body saved under
<work>/requests/) / cached tokens on the second turn. `--record` saves each client version's requests
(long text cut) under tests/data/client_requests/, which tests/test_client_requests.py replays.

Gibberish answers are expected: the weights are random, the protocol is what is tested. The model
ends its replies after a few tokens (see `bias_eos` in harness/agent_model.py), so a client asking for 32000 tokens finishes.
Needs node/npm and network access to the npm registry and PyPI on the first run; not part of the
test suite.

    python scripts/try_clients.py                      # all clients
    python scripts/try_clients.py --only claude,codex  # some
    python scripts/try_clients.py --record             # and refresh the recorded requests
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from harness import ROOT
from harness.agent_model import build_model
from harness.client_requests import recording, save
from harness.servers import free_port

NPM_PACKAGES = ["@anthropic-ai/claude-code", "@openai/codex", "opencode-ai", "@qwen-code/qwen-code", "cline"]
# npm 11 runs no install script it was not told to allow; Claude Code's fetches its native binary.
NPM_POSTINSTALL = {"@anthropic-ai/claude-code": "install.cjs"}
PIP_PACKAGES = ["aider-chat", "llm", "openai-agents", "langchain-openai", "litellm"]
CLIENTS = ["claude", "codex", "opencode", "qwen", "cline", "aider", "llm", "agents", "langchain", "litellm"]
SDK_PACKAGES = {"agents": "openai-agents", "langchain": "langchain-openai", "litellm": "litellm"}
# Each launched client's two turns: the arguments after `mlx-kvserve launch CLIENT --`.
AIDER = ["--yes", "--no-git", "--no-check-update", "--no-analytics", "--no-pretty", "--no-stream"]
LAUNCH_TURNS = {
    "claude": [["-p", "say hi"], ["-c", "-p", "again"]],
    "codex": [["exec", "say hi"], ["exec", "resume", "--last", "again"]],
    "opencode": [["run", "say hi"], ["run", "-c", "again"]],
    "qwen": [["-p", "say hi"], ["--continue", "-p", "again"]],
    "cline": [["say hi"], ["say it again"]],  # a second task (one word would be read as a command)
    "aider": [[*AIDER, "--message", "say hi"], [*AIDER, "--restore-chat-history", "--message", "again"]],
    "llm": [["say hi"], ["-c", "again"]],
}
RECORDED_NAMES = {"claude": "claude-code", "qwen": "qwen-code", **SDK_PACKAGES}  # the recordings' file names
LOG_LINE = re.compile(
    r"mlx_kvserve\.requests: id=(\S+) method=(\S+) endpoint=(\S+) status=(\d+) .*?prompt_tokens=(\S+) "
    r"cached_tokens=(\S+) completion_tokens=(\S+) .*?error=(\S+)"
)


# -- the server and a logging proxy in front of it ---------------------------------------------------


class Exchange(NamedTuple):
    label: str  # the client and turn that were running
    method: str
    path: str
    status: int
    request_file: str  # the saved request body
    error: str  # the response body of a status >= 400, else ""


class Proxy:
    """Forwards every request to the server unchanged (streams too), saves each request body under
    `folder`, and records an Exchange per request labelled with the client turn that is running."""

    def __init__(self, upstream_port: int, folder: Path):
        self.upstream_port, self.folder, self.label = upstream_port, folder, "-"
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()  # guards exchanges
        folder.mkdir(parents=True, exist_ok=True)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client closing a kept-alive connection
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    n = len(proxy.exchanges) + 1
                    proxy.exchanges.append(Exchange(proxy.label, self.command, self.path, 0, "", ""))
                name = f"{n:03d}-{proxy.label.replace(':', '-')}-{self.command}{self.path.split('?')[0].replace('/', '_')}.json"
                request_file = proxy.folder / name
                request_file.write_bytes(body)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=900)
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                resp = upstream.getresponse()
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                error = b""
                while chunk := resp.read1(65536):
                    if resp.status >= 400:
                        error += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                upstream.close()
                with proxy.lock:
                    proxy.exchanges[n - 1] = Exchange(
                        proxy.exchanges[n - 1].label,
                        self.command,
                        self.path,
                        resp.status,
                        str(request_file),
                        error.decode(errors="replace")[:2000],
                    )

            do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = _forward

        return Handler


class KvServer:
    """`mlx-kvserve run` on `model` with a fresh home folder, its log in `log_path`."""

    def __init__(self, model: Path, home: Path, log_path: Path):
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        self.port, self.log_path = free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(ROOT / ".venv" / "bin" / "mlx-kvserve"), "run", "--model", str(model), "--port", str(self.port)]
        env = dict(os.environ, MLX_KVSERVE_HOME=str(home), PYTHONUNBUFFERED="1")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not start: see {log_path}")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def request_lines(self, start: int) -> list[dict]:
        """The request log lines written since byte `start`."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        keys = ("id", "method", "endpoint", "status", "prompt_tokens", "cached_tokens", "completion_tokens", "error")
        return [dict(zip(keys, m.groups(), strict=True)) for m in LOG_LINE.finditer(text)]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- installing and running the clients --------------------------------------------------------------


def install(work: Path) -> None:
    """The npm clients into <work>/npm, the Python ones into the venv <work>/venv; skipped when there."""
    npm_bin = work / "npm" / "node_modules" / ".bin"
    if not all((npm_bin / name).exists() for name in ("claude", "codex", "opencode", "qwen", "cline")):
        subprocess.run(["npm", "install", "--prefix", str(work / "npm"), *NPM_PACKAGES], check=True)
        for package, script in NPM_POSTINSTALL.items():
            subprocess.run(["node", script], cwd=work / "npm" / "node_modules" / package, check=True)
    venv = work / "venv"
    if not all((venv / "bin" / name).exists() for name in ("aider", "llm", "litellm")):
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PIP_PACKAGES], check=True)


AGENTS_SCRIPT = """
import sys
from openai import AsyncOpenAI
from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1], api_key="unused"), use_for_tracing=False)

@function_tool
def get_weather(city: str) -> str:
    '''The weather in a city.'''
    return "sunny"

agent = Agent(name="helper", instructions="You are a helpful assistant.", model="default", tools=[get_weather])
first = Runner.run_sync(agent, "say hi")
print("turn 1:", repr(first.final_output))
second = Runner.run_sync(agent, first.to_input_list() + [{"role": "user", "content": "again"}])
print("turn 2:", repr(second.final_output))
"""

LANGCHAIN_SCRIPT = """
import sys
from typing import Literal
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

@tool
def get_weather(city: str) -> str:
    '''The weather in a city.'''
    return "sunny"

class Person(BaseModel):
    name: Literal["Alice", "Bob"]  # a random model fills a free string until max_tokens
    age: int

llm = ChatOpenAI(base_url=sys.argv[1], api_key="unused", model="default", max_tokens=256, timeout=600)
turn = sys.argv[2]
history = [HumanMessage("say hi")]
if turn == "1":
    reply = llm.bind_tools([get_weather]).invoke(history)
    print("bind_tools:", repr(reply.content), reply.tool_calls)
    print("with_structured_output:", llm.with_structured_output(Person).invoke("Alice is 30."))
else:
    first = llm.bind_tools([get_weather]).invoke(history)
    reply = llm.bind_tools([get_weather]).invoke(history + [AIMessage(first.content or "hi"), HumanMessage("again")])
    print("turn 2:", repr(reply.content), reply.tool_calls)
"""

LITELLM_SCRIPT = """
import sys
import litellm

weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
history = [{"role": "user", "content": "say hi"}]
first = litellm.completion(model="openai/default", api_base=sys.argv[1], api_key="unused", messages=history,
                           tools=[weather], max_tokens=64)
print("turn 1:", repr(first.choices[0].message.content))
history += [{"role": "assistant", "content": first.choices[0].message.content or "hi"},
            {"role": "user", "content": "again"}]
second = litellm.completion(model="openai/default", api_base=sys.argv[1], api_key="unused", messages=history,
                            tools=[weather], max_tokens=64, stream=True)
print("turn 2:", repr("".join(c.choices[0].delta.content or "" for c in second)))
"""


def client_turns(client: str, work: Path, url: str) -> tuple[Path, dict[str, str], list[list[str]]]:
    """(scratch folder, environment, the command of each turn) for `client` against the base URL
    `url`: an agent client through `mlx-kvserve launch`, an SDK with docs/agent-clients.md's settings."""
    folder = work / "scratch" / client
    shutil.rmtree(folder, ignore_errors=True)
    home = folder / "home"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE"))}
    npm_bin, venv_bin = work / "npm" / "node_modules" / ".bin", work / "venv" / "bin"
    # The launched clients' private profiles go under the scratch folder's own mlx-kvserve home.
    env.update(HOME=str(home), NO_COLOR="1", TERM="dumb", MLX_KVSERVE_HOME=str(folder / "kvserve-home"))
    env["PATH"] = os.pathsep.join([str(npm_bin), str(venv_bin), env.get("PATH", "")])
    if client in LAUNCH_TURNS:
        launch = [str(ROOT / ".venv" / "bin" / "mlx-kvserve"), "launch", client, "--url", url, "--"]
        return folder, env, [[*launch, *args] for args in LAUNCH_TURNS[client]]
    python = str(venv_bin / "python")
    if client == "agents":
        (folder / "agents_run.py").write_text(AGENTS_SCRIPT)
        return folder, env, [[python, "agents_run.py", f"{url}/v1"]]
    if client == "litellm":
        (folder / "litellm_run.py").write_text(LITELLM_SCRIPT)
        return folder, env, [[python, "litellm_run.py", f"{url}/v1"]]
    if client == "langchain":
        (folder / "langchain_run.py").write_text(LANGCHAIN_SCRIPT)
        return (
            folder,
            env,
            [[python, "langchain_run.py", f"{url}/v1", "1"], [python, "langchain_run.py", f"{url}/v1", "2"]],
        )
    raise ValueError(f"unknown client {client!r}")


def client_version(client: str, work: Path) -> str:
    """The installed client's version, as its --version prints it, or the SDK's package version ("" when
    it cannot say)."""
    bins = [work / "npm" / "node_modules" / ".bin", work / "venv" / "bin"]
    path = next((str(b / client) for b in bins if (b / client).exists()), client)
    cmd = [path, "--version"]
    if client in SDK_PACKAGES:
        python = str(work / "venv" / "bin" / "python")
        cmd = [python, "-c", f"import importlib.metadata as m; print(m.version({SDK_PACKAGES[client]!r}))"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r"\d+\.\d+(\.\d+)?", out)
    return found.group(0) if found else ""


def record(client: str, work: Path, exchanges: list[Exchange]) -> None:
    """Save the client version's requests for tests/test_client_requests.py (harness/client_requests.py)."""
    version = client_version(client, work)
    if not version:
        return
    requests = [(e.method, e.path, Path(e.request_file).read_bytes()) for e in exchanges if e.request_file]
    path = save(recording(RECORDED_NAMES.get(client, client), version, requests))
    print(f"  recorded {len(requests)} requests in {path}", flush=True)


class Result(NamedTuple):
    client: str
    works: bool
    failure: str  # the first failure: a completion request the server refused, or the client's exit, or ""
    refused: str  # the first request of any kind answered with a status >= 400, or ""
    turn2_prompt: int  # the prompt tokens of the last main request (0: none)
    turn2_cached: int
    turn1_prompt: int  # the prompt tokens of the main request before it
    requests: int


def run_client(client: str, work: Path, server: KvServer, proxy: Proxy, timeout_s: float, keep: bool) -> Result:
    folder, env, turns = client_turns(client, work, proxy.url)
    start, first_exchange = server.log_size(), len(proxy.exchanges)
    failure = ""
    for turn, cmd in enumerate(turns, 1):
        proxy.label = f"{client}:{turn}"
        out_path = folder / f"turn{turn}.out"
        with open(out_path, "w") as out:
            try:
                rc = subprocess.run(
                    cmd,
                    cwd=folder,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout_s,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        tail = out_path.read_text(errors="replace").strip().splitlines()[-6:]
        print(f"  {client} turn {turn}: exit {rc}\n    " + "\n    ".join(tail), flush=True)
        if rc != 0 and not failure:
            failure = f"turn {turn} exit {rc}: {tail[-1] if tail else ''} (output: {out_path})"
    proxy.label = "-"
    time.sleep(1.0)  # the request log line is written as a request ends
    exchanges = proxy.exchanges[first_exchange:]
    if keep:
        record(client, work, exchanges)
    errors = [e for e in exchanges if e.status >= 400]
    refused = (
        f"{errors[0].method} {errors[0].path} -> {errors[0].status}: {errors[0].error[:300]} ({errors[0].request_file})"
        if errors
        else ""
    )
    if any(e.method == "POST" for e in errors):  # a refused HEAD or GET the client gets past is not a failure
        failure = refused
    lines = [x for x in server.request_lines(start) if x["status"] == "200" and x["prompt_tokens"].isdigit()]
    biggest = max((int(x["prompt_tokens"]) for x in lines), default=0)
    # The second turn: the last request of a main size (not a small background call); the first: the
    # largest request before it.
    at = max((i for i, x in enumerate(lines) if int(x["prompt_tokens"]) >= biggest // 2), default=-1)
    last = lines[at] if at >= 0 else None
    before = max(lines[:at], key=lambda x: int(x["prompt_tokens"]), default=None) if at > 0 else None
    return Result(
        client,
        not failure,
        failure,
        refused,
        int(last["prompt_tokens"]) if last and before else 0,
        int(last["cached_tokens"]) if last and before and last["cached_tokens"].isdigit() else 0,
        int(before["prompt_tokens"]) if before else 0,
        len(exchanges),
    )


def table(results: list[Result]) -> list[str]:
    lines = [
        "| Client | Works | First failure | First 4xx/5xx | Turn 2 cached / prompt | of turn 1's prompt | Requests |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cached = (
            f"{r.turn2_cached:,} / {r.turn2_prompt:,} ({100 * r.turn2_cached / r.turn2_prompt:.1f}%)"
            if r.turn2_prompt
            else "-"
        )
        of_first = f"{100 * r.turn2_cached / r.turn1_prompt:.1f}%" if r.turn1_prompt and r.turn2_prompt else "-"
        failure, refused = (text.replace("|", "\\|").replace("\n", " ") or "-" for text in (r.failure, r.refused))
        works = "yes" if r.works else "no"
        lines.append(f"| {r.client} | {works} | {failure} | {refused} | {cached} | {of_first} | {r.requests} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--work",
        default=str(Path.home() / ".cache" / "mlx-kvserve-try-clients"),
        help="scratch folder: clients, model, logs (reused between runs)",
    )
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(CLIENTS)}")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per client turn")
    parser.add_argument("--context", type=int, default=131072, help="the model's context in tokens")
    parser.add_argument("--eos-boost", type=float, default=12.0, help="how soon the random model ends a reply")
    parser.add_argument("--record", action="store_true", help="save the requests under tests/data/client_requests")
    args = parser.parse_args()
    work = Path(args.work).expanduser().resolve()
    clients = args.only.split(",") if args.only else CLIENTS
    install(work)
    model = build_model(work / "model", args.context, args.eos_boost)
    run_dir = work / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    server = KvServer(model, work / "server-home", run_dir / "server.log")
    proxy = Proxy(server.port, run_dir / "requests")
    print(f"server {server.url} (log {server.log_path}), proxy {proxy.url}, requests in {proxy.folder}", flush=True)
    results = []
    try:
        for client in clients:
            print(f"{client}:", flush=True)
            results.append(run_client(client, work, server, proxy, args.timeout, args.record))
    finally:
        proxy.server.shutdown()
        server.stop()
    report = table(results)
    (run_dir / "report.md").write_text("\n".join(report) + "\n")
    (run_dir / "results.json").write_text(json.dumps([r._asdict() for r in results], indent=2))
    print("\n".join(report))
    print(f"\n{run_dir}")


if __name__ == "__main__":
    main()
