"""`mlx-kvserve launch CLIENT` (issue 47): what each client is given (`--dry-run`'s output), the key
kept out of sight, the private files, a missing client, and a launch that runs a (stand-in) client
with the profile's environment. A small HTTP server stands in for mlx-kvserve; no model, no real client
(the real ones run with `scripts/agents.py clients`; tests/scripts/test_entry_points.py runs llm)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from mlx_kvserve.cli import cli
from mlx_kvserve.launch import command
from mlx_kvserve.launch.clients import CLIENTS
from mlx_kvserve.launch.profile import KEY_PLACEHOLDER, Profile, ProfileFile, write
from mlx_kvserve.launch.target import NO_KEY, Target, probe


class FakeServer:
    """/health and /v1/models as mlx-kvserve answers them; /v1/models wants `key` when one is set."""

    def __init__(self, key: str = "", card_context: int | None = 4096):
        self.seen_auth: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    return self._json(200, {"status": "ok", "model": "tiny-model", "context_length": 8192})
                if self.path == "/v1/models":
                    fake.seen_auth.append(self.headers.get("Authorization", ""))
                    if key and self.headers.get("Authorization") != f"Bearer {key}":
                        return self._json(401, {"error": {"message": "bad key"}})
                    card = {"id": "tiny-model", "object": "model"}
                    card |= {"context_length": card_context} if card_context else {}
                    return self._json(200, {"object": "list", "data": [card]})
                self._json(404, {})

            def _json(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_KVSERVE_API_KEY", raising=False)
    return tmp_path / "home"


def dry_run(*args: str, env: dict | None = None) -> str:
    result = CliRunner().invoke(cli, ["launch", "--dry-run", *args], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_server_is_read_from_health_and_the_model_card(server):
    assert probe(server.url) == Target(server.url, "tiny-model", 4096, NO_KEY)  # the card's window first
    server.close()
    assert probe(server.url) is None


def test_without_a_window_on_the_card_healths_is_used():
    fake = FakeServer(card_context=None)
    try:
        assert probe(fake.url).context_length == 8192
    finally:
        fake.close()


@pytest.fixture
def long_server():
    fake = FakeServer(card_context=200_000)
    yield fake
    fake.close()


def test_claude_codes_dry_run_shows_everything_it_sets(long_server, home):
    server = long_server
    out = dry_run("claude", "--url", server.url, "--", "-p", "say hi")
    folder = home / "launch" / "claude"
    assert out == (
        "# mlx-kvserve launch claude\n"
        "# environment\n"
        "unset ANTHROPIC_API_KEY\n"
        f"export ANTHROPIC_BASE_URL={server.url}\n"
        "export ANTHROPIC_AUTH_TOKEN=unused\n"
        f"export CLAUDE_CONFIG_DIR={folder}\n"
        "export ANTHROPIC_MODEL=tiny-model\n"
        "export ANTHROPIC_SMALL_FAST_MODEL=tiny-model\n"
        "export ANTHROPIC_DEFAULT_HAIKU_MODEL=tiny-model\n"
        "export ANTHROPIC_DEFAULT_SONNET_MODEL=tiny-model\n"
        "export ANTHROPIC_DEFAULT_OPUS_MODEL=tiny-model\n"
        "export CLAUDE_CODE_ATTRIBUTION_HEADER=0\n"
        "export CLAUDE_CODE_TOTAL_TOKENS_REMINDER=off\n"
        "export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1\n"
        "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=200000\n"
        "export CLAUDE_CODE_AUTO_COMPACT_WINDOW=200000\n"
        f"# file merged into {folder}/.claude.json\n"
        "{\n"
        '  "hasCompletedOnboarding": true\n'
        "}\n"
        "# command\n"
        "claude -p 'say hi'\n"
    )
    assert not folder.exists()  # a dry run writes nothing


def test_claude_code_is_warned_of_a_short_context(server, home):
    """Claude Code reads an auto-compact window under 100k as 100k (and says so on every run): none is
    set, and the user is told when the model's context is below Claude Code's own prompt."""
    out = dry_run("claude", "--url", server.url)
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in out and "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=4096\n" in out
    assert "# note: the served context (4,096 tokens) is too small for Claude Code, whose own prompt" in out
    fake = FakeServer(card_context=32768)  # compacts at the server's "prompt is too long": no note
    try:
        out = dry_run("claude", "--url", fake.url)
        assert "# note" not in out and "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in out
    finally:
        fake.close()


def test_codexs_dry_run_has_its_provider_window_and_the_git_check_skipped(server, home):
    out = dry_run("codex", "--url", server.url, "--", "exec", "resume", "--last", "again")
    folder = home / "launch" / "codex"
    assert out == (
        "# mlx-kvserve launch codex\n"
        "# environment\n"
        f"export CODEX_HOME={folder}\n"
        "export MLX_KVSERVE_LAUNCH_API_KEY=unused\n"
        f"# file written to {folder}/config.toml\n"
        f"# Written by mlx-kvserve launch for the server at {server.url}; rewritten on every launch.\n"
        'model = "tiny-model"\n'
        'model_provider = "mlx-kvserve"\n'
        "model_context_window = 4096\n"
        "model_auto_compact_token_limit = 3276\n"
        "\n"
        "[model_providers.mlx-kvserve]\n"
        'name = "mlx-kvserve"\n'
        f'base_url = "{server.url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "MLX_KVSERVE_LAUNCH_API_KEY"\n'
        "# command\n"
        "codex exec --skip-git-repo-check resume --last again\n"
    )


def _file(out: str, name: str) -> str:
    """The contents `--dry-run` shows for the file whose path ends with `name`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# file ") and line.endswith(name))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# "))
    return "\n".join(lines[start + 1 : end])


def test_the_other_clients_dry_runs(server, home):
    v1 = f"{server.url}/v1"
    out = dry_run("opencode", "--url", server.url, "--", "run", "say hi")
    config = json.loads(_file(out, "opencode.json"))
    provider = config["provider"]["mlx-kvserve"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"]["baseURL"] == v1
    assert provider["models"]["tiny-model"]["limit"]["context"] == 4096
    assert config["model"] == config["small_model"] == "mlx-kvserve/tiny-model"
    assert f"export OPENCODE_CONFIG={home}/launch/opencode/opencode.json" in out
    assert out.endswith("opencode run 'say hi'\n")

    out = dry_run("qwen", "--url", server.url, "--", "-p", "say hi")
    assert f"export OPENAI_BASE_URL={v1}\nexport OPENAI_API_KEY=unused\nexport OPENAI_MODEL=tiny-model\n" in out
    settings = json.loads(_file(out, "settings.json"))
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["modelProviders"]["openai"][0]["generationConfig"]["contextWindowSize"] == 4096

    out = dry_run("cline", "--url", server.url, "--", "say hi")
    assert f"export CLINE_DIR={home}/launch/cline\n" in out and out.endswith("cline 'say hi'\n")
    settings = json.loads(_file(out, "providers.json"))["providers"]["openai-compatible"]["settings"]
    assert settings == {"provider": "openai-compatible", "apiKey": "unused", "model": "tiny-model", "baseUrl": v1}
    registry = json.loads(_file(out, "models.json"))["providers"]["openai-compatible"]
    assert registry["models"]["tiny-model"]["contextWindow"] == 4096

    out = dry_run("aider", "--url", server.url, "--", "--message", "say hi")
    assert json.loads(_file(out, "model-metadata.json"))["openai/tiny-model"]["max_input_tokens"] == 4096
    meta = f"{home}/launch/aider/model-metadata.json"
    assert out.endswith(
        f"aider --model openai/tiny-model --openai-api-base {v1} --model-metadata-file {meta} --message 'say hi'\n"
    )

    out = dry_run("llm", "--url", server.url, "--", "say hi")
    assert _file(out, "extra-openai-models.yaml") == (
        f'- model_id: kvserve\n  model_name: "tiny-model"\n  api_base: "{v1}"\n  supports_tools: true\n'
        "  api_key_name: kvserve"
    )
    assert _file(out, "default_model.txt") == "kvserve" and json.loads(_file(out, "keys.json")) == {"kvserve": "unused"}


def test_a_servers_key_is_sent_and_never_shown(home):
    fake = FakeServer(key="sk-secret-123")
    try:
        for client in CLIENTS:
            out = dry_run(client, "--url", fake.url, env={"MLX_KVSERVE_API_KEY": "sk-secret-123"})
            assert "sk-secret-123" not in out and KEY_PLACEHOLDER in out, client
            assert "tiny-model" in out and (
                "4096" in out or "4,096" in out or client == "llm"
            )  # the card was read with the key
        assert set(fake.seen_auth) == {"Bearer sk-secret-123"}
    finally:
        fake.close()


def test_with_no_server_a_dry_run_says_it_would_start_one(home, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 1\n")  # nothing listens on port 1
    out = dry_run("codex", "--config", str(config), "--model", "org/some-model")
    assert out.startswith(
        f"# no server at http://127.0.0.1:1: would start `mlx-kvserve run --host 127.0.0.1 --port 1 "
        f"--model org/some-model --config {config}` and wait for it\n"
    )
    assert 'model = "org/some-model"' in out


def test_a_url_with_no_server_is_an_error(home):
    result = CliRunner().invoke(cli, ["launch", "claude", "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "no mlx-kvserve server answers at http://127.0.0.1:1/health" in result.output


def test_a_missing_client_names_its_install_command(server, home, tmp_path):
    result = CliRunner().invoke(cli, ["launch", "codex", "--url", server.url], env={"PATH": str(tmp_path)})
    assert result.exit_code == 1
    assert "codex is not installed" in result.output and "npm install -g @openai/codex" in result.output


def test_files_are_private_and_claudes_own_state_is_kept(tmp_path):
    state = tmp_path / "claude" / ".claude.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"numStartups": 3, "hasCompletedOnboarding": False}))
    profile = Profile(
        "claude",
        ["claude"],
        files=[
            ProfileFile(state, '{"hasCompletedOnboarding": true}', merge=True),
            ProfileFile(tmp_path / "new" / "config.toml", "model = 1\n"),
        ],
    )
    write(profile)
    assert json.loads(state.read_text()) == {"numStartups": 3, "hasCompletedOnboarding": True}
    assert (tmp_path / "new" / "config.toml").read_text() == "model = 1\n"
    assert stat.S_IMODE((tmp_path / "new" / "config.toml").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_a_launch_runs_the_client_with_its_profile(server, tmp_path):
    """The whole command in a process of its own (it execs the client): a stand-in `llm` records
    its arguments, its environment and the private files it was pointed at."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record.json"
    bin_dir.mkdir()
    fake = bin_dir / "llm"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "folder = os.environ['LLM_USER_PATH']\n"
        f"json.dump({{'argv': sys.argv[1:], 'folder': folder, 'files': sorted(os.listdir(folder))}}, open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", MLX_KVSERVE_HOME=str(tmp_path / "home"))
    env.pop("MLX_KVSERVE_API_KEY", None)
    run = [sys.executable, "-m", "mlx_kvserve", "launch", "llm", "--url", server.url, "--", "say hi"]
    result = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"llm -> {server.url}, model tiny-model, context 4096 tokens" in result.stderr
    seen = json.loads(record.read_text())
    assert seen == {
        "argv": ["say hi"],
        "folder": str(tmp_path / "home" / "launch" / "llm"),
        "files": ["default_model.txt", "extra-openai-models.yaml", "keys.json"],
    }


def test_a_sigterm_goes_to_the_client_and_the_started_server_is_stopped_after_it():
    """A closed terminal or a `kill` ends launch's client, and the server it started is not left running."""

    class Started:
        stopped = False

        def stop(self):
            self.stopped = True

    started = Started()
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    client = Profile("x", ["x", "-c", "import time; time.sleep(30)"])
    assert command._run_then_stop(sys.executable, client, started) == 128 + signal.SIGTERM
    assert started.stopped and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_started_server_is_stopped_when_the_client_exits(tmp_path):
    class Started:
        stopped = False

        def stop(self):
            self.stopped = True

    started = Started()
    profile = Profile("x", ["x"], {"LAUNCH_TEST": "7"})
    script = "import os, sys; sys.exit(int(os.environ['LAUNCH_TEST']))"
    assert command._run_then_stop(sys.executable, Profile("x", ["x", "-c", script], profile.env), started) == 7
    assert started.stopped


def test_a_server_that_wants_a_key_is_named_in_the_error(home):
    fake = FakeServer(key="sk-secret-123")
    try:
        result = CliRunner().invoke(cli, ["launch", "llm", "--url", fake.url])
        assert result.exit_code == 1 and "wants an API key: set $MLX_KVSERVE_API_KEY" in result.output
        result = CliRunner().invoke(cli, ["launch", "llm", "--url", fake.url], env={"MLX_KVSERVE_API_KEY": "wrong"})
        assert result.exit_code == 1 and "refuses the key given" in result.output
    finally:
        fake.close()


FAKE_RUN = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--fail" in sys.argv:
    print("cannot load the model"); sys.exit(3)
time.sleep(0.5)  # a server takes a moment to load
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "model": "started", "context_length": 2048}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_started_server_is_waited_for_and_stopped(tmp_path):
    from harness.servers import free_port

    from mlx_kvserve.errors import KVServeError
    from mlx_kvserve.launch.server import StartedServer

    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    port = free_port()
    started = StartedServer(["--port", str(port)], tmp_path / "server.log", (sys.executable, str(script)))
    target = started.wait(f"http://127.0.0.1:{port}", "", 30, print, poll_s=0.1)
    assert target == Target(f"http://127.0.0.1:{port}", "started", 2048, NO_KEY)
    started.stop()
    assert started.proc.returncode is not None

    failing = StartedServer(["--port", "1", "--fail"], tmp_path / "fail.log", (sys.executable, str(script)))
    with pytest.raises(KVServeError) as err:
        failing.wait("http://127.0.0.1:1", "", 30, print, poll_s=0.1)
    assert "exited with code 3" in err.value.message and str(tmp_path / "fail.log") in err.value.message
    assert "cannot load the model" in (tmp_path / "fail.log").read_text()
