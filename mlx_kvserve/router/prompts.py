"""What the router reads from a request before it picks a backend: the session and the prompt's token ids.

The token ids are computed exactly as a backend computes them (the same parser, the same tokenizer and chat
template), so the chained block hashes match the ones the backend reports. Anything the router cannot read
is no error here: it routes without a cache estimate and the backend answers the request's 4xx itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..server.anthropic.parse import to_openai
from ..server.openai import parse as oa
from ..server.responses import parse as rs

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
CHAT_PATH, TEXT_PATH, MESSAGES_PATH = "/v1/chat/completions", "/v1/completions", "/v1/messages"
RESPONSES_PATH = "/v1/responses"
GENERATION_PATHS = (CHAT_PATH, TEXT_PATH, MESSAGES_PATH, RESPONSES_PATH)
_PARSE_DEFAULTS = oa.Defaults(max_tokens=1, temperature=0.0, top_p=1.0)  # sampling does not change the prompt


class PromptInfo(NamedTuple):
    tokens: list[int] | None  # None: not readable here (no tokenizer, or a request the backend will refuse)
    session_id: str | None
    stream: bool
    model: str | None = None  # the body's `model` (None: none named; routed to every backend's default)


def session_of(headers: Mapping[str, str], body: Any, header: str = SESSION_HEADER) -> str | None:
    """The session: the header, else OpenAI's `prompt_cache_key` (one conversation, as Codex sends it),
    else OpenAI's `user`, else Anthropic's `metadata.user_id`."""
    if value := headers.get(header):
        return value
    if not isinstance(body, dict):
        return None
    for name in ("prompt_cache_key", "user"):
        if isinstance(body.get(name), str) and body[name]:
            return body[name]
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str) and metadata["user_id"]:
        return metadata["user_id"]
    return None


def model_of(body: Any) -> str | None:
    """The model a request body names (None when it names none as a string)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


class PromptReader:
    """Token ids of proxied requests. `tokenizer`: the served model's (mlx-lm's TokenizerWrapper or a
    transformers tokenizer); None routes every request without a cache estimate."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer

    def read(self, path: str, body: Any, headers: Mapping[str, str], header: str = SESSION_HEADER) -> PromptInfo:
        stream = isinstance(body, dict) and body.get("stream") is True
        return PromptInfo(self.tokens(path, body), session_of(headers, body, header), stream, model_of(body))

    def tokens(self, path: str, body: Any) -> list[int] | None:
        if self.tokenizer is None or path not in GENERATION_PATHS:
            return None
        try:
            if path == MESSAGES_PATH:
                body = to_openai(body)
            elif path == RESPONSES_PATH:
                if rs.previous_id(body) is not None:  # the stored history is on a backend, not here
                    return None
                body = rs.parse(body, []).chat
            req = oa.parse_request(body, "text" if path == TEXT_PATH else "chat", _PARSE_DEFAULTS)
            if req.kind == "text":
                return list(req.prompt) if isinstance(req.prompt, list) else list(self.tokenizer.encode(req.prompt))
            # As Engine.chat_tokens renders it: tools only when given, the template's kwargs as sent.
            extra = dict(req.template_kwargs)
            if req.tools:
                extra["tools"] = req.tools.tools
            return list(self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, **extra))
        except Exception as exc:  # parse errors, template errors: the backend answers them
            log.debug("routing %s without a cache estimate: %s", path, exc)
            return None


def load_tokenizer(spec: str) -> Any:
    """mlx-lm's tokenizer for a model folder or hub id (what the backends load). Raises what mlx-lm raises."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer  # fetches a hub id's tokenizer files only

    path = Path(spec).expanduser()
    return mlx_load_tokenizer(path if path.is_dir() else spec)
