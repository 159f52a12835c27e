"""Per client: how it is installed and the Profile that points it at the server.

Each builder takes the server (Target), the client's private folder (<home>/launch/CLIENT) and the
arguments given after `--`, and sets what docs/agent-clients.md explains: the base URL, the key, the
served model id under every name the client asks for, the context window where the client reads one
(it compacts or trims before the server has to refuse), and what keeps the prompt's prefix the same
from turn to turn. Pure: nothing is written or run here.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .profile import Profile, ProfileFile, json_text
from .target import Target

KEY_ENV = "MLX_KVSERVE_LAUNCH_API_KEY"  # where a client that names its key variable reads the key
PROVIDER = "mlx-kvserve"
CLAUDE_MIN_COMPACT_WINDOW = 100_000  # Claude Code 2.1 reads a smaller CLAUDE_CODE_AUTO_COMPACT_WINDOW as this
CLAUDE_PROMPT_TOKENS = 13_000  # its system prompt and tools (2.1.332: 12.4k with -p, 13.8k interactive)


def claude(target: Target, folder: Path, args: list[str]) -> Profile:
    """Claude Code: Anthropic's variables; a private CLAUDE_CONFIG_DIR whose .claude.json has the
    onboarding done (it checks api.anthropic.com otherwise, and fails offline). The key goes as a
    bearer token: an ANTHROPIC_API_KEY makes interactive Claude Code ask whether to use it."""
    env = {
        "ANTHROPIC_BASE_URL": target.url,
        "ANTHROPIC_AUTH_TOKEN": target.api_key,
        "CLAUDE_CONFIG_DIR": str(folder),
        # Every model name it asks for: the main one, the small one for background calls, and /model's.
        **{
            name: target.model
            for name in (
                "ANTHROPIC_MODEL",
                "ANTHROPIC_SMALL_FAST_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL",
            )
        },
        # Text that changes per request at the top of the prompt (the billing line) or in the last turn
        # (the running token count) would cost cache hits.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no update checks, telemetry or error reports
    }
    notes = []
    if target.context_length:  # the window it assumes for a model id not starting with claude- (200k otherwise)
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(target.context_length)
    # A smaller auto-compact window is read as its 100k minimum, with a warning on every run: below it,
    # Claude Code compacts when the server answers "prompt is too long".
    if target.context_length >= CLAUDE_MIN_COMPACT_WINDOW:
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(target.context_length)
    if 0 < target.context_length < CLAUDE_PROMPT_TOKENS + 4096:  # its prompt and a few turns
        notes.append(
            f"the served context ({target.context_length:,} tokens) is too small for Claude Code, whose own "
            f"prompt is about {CLAUDE_PROMPT_TOKENS:,} tokens: serve a model with a long context "
            "(README: Agent clients)"
        )
    state = {"hasCompletedOnboarding": True}
    return Profile(
        "claude",
        ["claude", *args],
        env,
        unset=("ANTHROPIC_API_KEY",),
        files=[ProfileFile(folder / ".claude.json", json_text(state), merge=True)],
        secret=target.secret,
        notes=tuple(notes),
    )


def codex(target: Target, folder: Path, args: list[str]) -> Profile:
    """Codex CLI: a private CODEX_HOME whose config.toml names the server as a Responses API provider
    with the served window. `codex exec` gets --skip-git-repo-check (it refuses to run outside a git
    repository otherwise, resume included)."""
    lines = [
        f"# Written by mlx-kvserve launch for the server at {target.url}; rewritten on every launch.",
        f"model = {json.dumps(target.model)}",
        f"model_provider = {json.dumps(PROVIDER)}",
    ]
    if target.context_length:  # it compacts at the limit, before the server has to refuse
        lines.append(f"model_context_window = {target.context_length}")
        lines.append(f"model_auto_compact_token_limit = {target.context_length * 8 // 10}")
    lines += [
        "",
        f"[model_providers.{PROVIDER}]",
        f"name = {json.dumps(PROVIDER)}",
        f"base_url = {json.dumps(target.v1)}",
        'wire_api = "responses"',
        f"env_key = {json.dumps(KEY_ENV)}",
    ]
    if args[:1] == ["exec"] and "--skip-git-repo-check" not in args:
        args = ["exec", "--skip-git-repo-check", *args[1:]]
    return Profile(
        "codex",
        ["codex", *args],
        {"CODEX_HOME": str(folder), KEY_ENV: target.api_key},
        files=[ProfileFile(folder / "config.toml", "\n".join(lines) + "\n")],
        secret=target.secret,
    )


def opencode(target: Target, folder: Path, args: list[str]) -> Profile:
    """opencode: OPENCODE_CONFIG names a private file (merged over the user's own config by opencode)
    with an @ai-sdk/openai-compatible provider, its window, and the model as both main and small."""
    model: dict = {"name": target.model, "tool_call": True}
    if target.context_length:
        model["limit"] = {"context": target.context_length, "output": max(target.context_length // 4, 1)}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER,
                "options": {"baseURL": target.v1, "apiKey": "{env:" + KEY_ENV + "}"},
                "models": {target.model: model},
            }
        },
        "model": f"{PROVIDER}/{target.model}",
        "small_model": f"{PROVIDER}/{target.model}",  # titles and summaries: the same model, not a hosted one
        "autoupdate": False,
        "share": "disabled",
    }
    path = folder / "opencode.json"
    env = {"OPENCODE_CONFIG": str(path), KEY_ENV: target.api_key}
    return Profile(
        "opencode",
        ["opencode", *args],
        env,
        files=[ProfileFile(path, json_text(config))],
        secret=target.secret,
    )


def qwen(target: Target, folder: Path, args: list[str]) -> Profile:
    """Qwen Code: the OPENAI_* variables, and a private QWEN_HOME whose settings.json selects the
    OpenAI protocol (no /auth dialog) with the served window (contextWindowSize)."""
    generation = {"contextWindowSize": target.context_length} if target.context_length else {}
    entry = {"id": target.model, "name": target.model, "baseUrl": target.v1, "envKey": "OPENAI_API_KEY"}
    settings = {
        "modelProviders": {"openai": [entry | ({"generationConfig": generation} if generation else {})]},
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": target.model},
    }
    env = {
        "QWEN_HOME": str(folder),
        "OPENAI_BASE_URL": target.v1,
        "OPENAI_API_KEY": target.api_key,
        "OPENAI_MODEL": target.model,
    }
    return Profile(
        "qwen",
        ["qwen", *args],
        env,
        files=[ProfileFile(folder / "settings.json", json_text(settings))],
        secret=target.secret,
    )


def cline(target: Target, folder: Path, args: list[str]) -> Profile:
    """Cline CLI: a private CLINE_DIR holding what `cline auth -p openai -b URL` writes (the provider
    `openai-compatible`), and its model registry entry with the window (Cline assumes 128k otherwise)."""
    settings = folder / "data" / "settings"
    provider = {"provider": "openai-compatible", "apiKey": target.api_key, "model": target.model, "baseUrl": target.v1}
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    providers = {
        "version": 1,
        "lastUsedProvider": "openai-compatible",
        "modes": {},
        "providers": {"openai-compatible": {"settings": provider, "updatedAt": stamp, "tokenSource": "manual"}},
    }
    model: dict = {"id": target.model, "name": target.model, "capabilities": ["streaming", "tools"]}
    if target.context_length:
        model |= {"contextWindow": target.context_length, "maxInputTokens": target.context_length}
    registry = {
        "version": 1,
        "providers": {
            "openai-compatible": {
                "provider": {"name": "OpenAI Compatible", "baseUrl": target.v1, "defaultModelId": target.model},
                "models": {target.model: model},
            }
        },
    }
    return Profile(
        "cline",
        ["cline", *args],
        {"CLINE_DIR": str(folder)},
        files=[
            ProfileFile(settings / "providers.json", json_text(providers)),
            ProfileFile(settings / "models.json", json_text(registry)),
        ],
        secret=target.secret,
    )


def aider(target: Target, folder: Path, args: list[str]) -> Profile:
    """aider (LiteLLM's OpenAI provider): the model and base URL as flags, the key in OPENAI_API_KEY,
    and a model metadata file with the window (aider warns about an unknown model and asks otherwise)."""
    name = f"openai/{target.model}"
    window = target.context_length or 8192
    metadata = {
        name: {
            "max_input_tokens": window,
            "max_tokens": window,
            "max_output_tokens": max(window // 4, 1),
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "litellm_provider": "openai",
            "mode": "chat",
            "supports_function_calling": True,
        }
    }
    path = folder / "model-metadata.json"
    argv = ["aider", "--model", name, "--openai-api-base", target.v1, "--model-metadata-file", str(path), *args]
    return Profile(
        "aider",
        argv,
        {"OPENAI_API_KEY": target.api_key},
        files=[ProfileFile(path, json_text(metadata))],
        secret=target.secret,
    )


def llm(target: Target, folder: Path, args: list[str]) -> Profile:
    """llm: a private LLM_USER_PATH with the server as an extra OpenAI model, `kvserve`, made the
    default (so `llm 'say hi'` needs no -m), with tools on (llm refuses tools to a model without)."""
    entry = [
        "- model_id: kvserve",
        f"  model_name: {json.dumps(target.model)}",
        f"  api_base: {json.dumps(target.v1)}",
        "  supports_tools: true",
        "  api_key_name: kvserve",  # its own key: llm would send the user's OpenAI key otherwise
    ]
    files = [
        ProfileFile(folder / "keys.json", json_text({"kvserve": target.api_key})),
        ProfileFile(folder / "extra-openai-models.yaml", "\n".join(entry) + "\n"),
        ProfileFile(folder / "default_model.txt", "kvserve\n"),
    ]
    return Profile("llm", ["llm", *args], {"LLM_USER_PATH": str(folder)}, files=files, secret=target.secret)


class Client(NamedTuple):
    name: str
    program: str  # the command on PATH
    install: str  # how to install it, for the message when it is missing
    build: Callable[[Target, Path, list[str]], Profile]


CLIENTS = {
    c.name: c
    for c in (
        Client("claude", "claude", "npm install -g @anthropic-ai/claude-code", claude),
        Client("codex", "codex", "npm install -g @openai/codex", codex),
        Client("opencode", "opencode", "npm install -g opencode-ai", opencode),
        Client("qwen", "qwen", "npm install -g @qwen-code/qwen-code", qwen),
        Client("cline", "cline", "npm install -g cline", cline),
        Client("aider", "aider", "python -m pip install aider-install && aider-install", aider),
        Client("llm", "llm", "pipx install llm  (or: python -m pip install llm)", llm),
    )
}
