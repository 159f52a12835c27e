"""The Anthropic Messages API request: a `POST /v1/messages` body translated into the OpenAI chat
body that serves it (the reply's shape is in reply.py, the routes in routes.py), so it goes through the
same parsing, chat template, engine and block cache as `/v1/chat/completions`: a long system prompt with
tools hits the cache from either API. Pure functions.
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidRequestError, ValidationError
from .. import cache_control
from ..effort import effort_kwargs, parse_effort
from ..keep_alive import parse_keep_alive
from ..openai.tools import check_function
from .context import PromptSize, apply_context_management, strip_billing_line

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k"}
FIELDS |= {"metadata", "tools", "tool_choice", "cache_control", "thinking", "output_config", "context_management"}
# Accepted, with no meaning here: `metadata` names the caller, `service_tier` picks a hosted capacity pool.
FIELDS |= {"service_tier"}
# Accepted, with no meaning here: `safeguards` asks Anthropic's hosted classifiers (Claude Code's auto mode
# sends `dangerous_tool_use`) to review tool calls; no classifier runs here, and the answer is the same.
FIELDS |= {"safeguards"}
FIELDS |= {"keep_alive"}  # Ollama's: how long the model stays loaded (server/keep_alive.py)


# --- request ------------------------------------------------------------------------------------------


def _check_cache_control(block: dict[str, Any], where: str) -> None:
    cache_control.ttl_of(block, where)  # a bad marker is a 400; good ones pin (server/cache_control.py)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ValidationError(f"{where} must be a string or an array of content blocks", param=where)
    for j, block in enumerate(content):
        _check_cache_control(block, f"{where}[{j}]")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ValidationError(f"{where}.text must be a string", param=where)
    return block["text"]


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    parts = _blocks(content, f"{where}.content")
    if any(p.get("type") != "text" for p in parts):
        raise InvalidRequestError(f"{where}.content may hold text blocks only", param=where)
    text = "".join(_text(p, where) for p in parts)
    return f"Error: {text}" if block.get("is_error") else text


def _message(msg: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: tool_result blocks become `tool` messages, in order.
    A `system` message (Claude Code sends them mid-conversation) stays a system turn; a template that
    takes none there gets it merged into a user turn (messages.merge_system_turns)."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
        raise ValidationError(f"{where} must be an object with role 'user', 'assistant' or 'system'", param="messages")
    if msg["role"] == "system":
        return _system(msg.get("content"), f"{where}.content")
    role, out, text, calls, thinking = msg["role"], [], [], [], []
    for j, block in enumerate(_blocks(msg.get("content"), f"{where}.content")):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            text.append(_text(block, at))
        elif kind == "image" and role == "user":
            text.append(_image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ValidationError(f"{at} needs a string 'id' and 'name'", param="messages")
            args = block.get("input", {})
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}}
            )
        elif kind == "tool_result" and role == "user":
            if text:  # keep the order of text and results
                out.append({"role": "user", "content": _content(text)})
                text = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ValidationError(f"{at}.tool_use_id must be a string", param="messages")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _result_text(block, at)})
        elif kind == "thinking" and role == "assistant":
            thinking.append(block.get("thinking", ""))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by Anthropic for its own models: nothing here can read it, so it is not rendered
        else:
            raise InvalidRequestError(f"{at}: content block type {kind!r} is not supported here", param="messages")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        return [message]
    return out + ([{"role": "user", "content": _content(text)}] if text or not out else [])


def _content(parts: list[Any]) -> Any:
    """User content: its text, or OpenAI content parts when it holds images (in their order)."""
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic image block as an OpenAI image_url part: a base64 source becomes a data URL, a
    url source stays a URL (fetched only with [server] fetch_image_urls)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ValidationError(f"{where}: an 'image' block's source must be an object", param="messages")
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise ValidationError(f"{where}.source needs a string 'media_type' and 'data'", param="messages")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}, "where": where}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}, "where": where}
    raise InvalidRequestError(f"{where}: an 'image' block's source.type must be 'base64' or 'url'", param="messages")


def _system(raw: Any, where: str = "system") -> list[dict[str, Any]]:
    """The system prompt as a system message, without Claude Code's billing line (anthropic/context.py)."""
    if raw is None:
        return []
    blocks = _blocks(raw, where)
    if any(b.get("type") != "text" for b in blocks):
        raise ValidationError(f"'{where}' may hold text blocks only", param=where)
    return [{"role": "system", "content": "".join(_text(b, where) for b in strip_billing_line(blocks))}]


def _tools(body: dict[str, Any], out: dict[str, Any]) -> None:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None:
        if not isinstance(raw, list):
            raise ValidationError("'tools' must be an array", param="tools")
        functions = []
        for i, tool in enumerate(raw):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise InvalidRequestError(
                    f"tools[{i}]: only client tools (name, input_schema) are supported", param="tools"
                )
            _check_cache_control(tool, f"tools[{i}]")
            # OpenAI's key order: templates render tools with tojson, so the same tool is the same text
            # (and the same cached prefix) from either API.
            fn = {"name": tool.get("name")}
            if "description" in tool:
                fn["description"] = tool["description"]
            fn["parameters"] = tool.get("input_schema", {})
            if tool.get("strict") is not None:
                fn["strict"] = tool["strict"]  # arguments held to input_schema by constrained decoding
            functions.append({"type": "function", "function": check_function(fn, f"tools[{i}]", "tools")})
        out["tools"] = functions
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "none", "any", "tool"):
            raise ValidationError("'tool_choice' must be {type: auto | none | any | tool}", param="tool_choice")
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise ValidationError("'tool_choice' {type: tool} needs a 'name'", param="tool_choice")
        out["tool_choice"] = {  # OpenAI's names for the same choices
            "auto": "auto",
            "none": "none",
            "any": "required",
            "tool": {"type": "function", "function": {"name": choice.get("name")}},
        }[choice["type"]]
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False


def to_openai(body: Any, count_only: bool = False, size: PromptSize | None = None) -> dict[str, Any]:
    """The OpenAI chat body that serves an Anthropic Messages body. Fields not served are a 400
    naming them; `max_tokens` is required (not for count_tokens). `size`: the prompt's size without
    tool-use clearing, for that edit's token thresholds (anthropic/context.py; None: not reached)."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
    if body.get("max_tokens") is None and not count_only:
        raise ValidationError("'max_tokens' is required", param="max_tokens")
    if not isinstance(body.get("metadata", {}), dict):
        raise ValidationError("'metadata' must be an object", param="metadata")
    if not isinstance(body.get("service_tier", ""), str):
        raise ValidationError("'service_tier' must be a string", param="service_tier")
    parse_keep_alive(body.get("keep_alive"))
    _check_safeguards(body.get("safeguards"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ValidationError("'messages' must be a non-empty array", param="messages")
    messages = _system(body.get("system")) + [m for i, msg in enumerate(raw) for m in _message(msg, i)]
    messages = apply_context_management(body.get("context_management"), messages, size)
    out: dict[str, Any] = {"messages": messages, "max_tokens": None if count_only else body["max_tokens"]}
    for name in ("model", "stream", "temperature", "top_p", "top_k"):  # the same names and meanings
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    _check_cache_control(body, "request")  # automatic caching: the whole prompt
    _tools(body, out)
    effort = _output_config(body.get("output_config"), out)
    out["chat_template_kwargs"] = effort_kwargs(effort, thinking_wanted(body))
    return out


def _check_safeguards(raw: Any) -> None:
    """`safeguards`: a list of objects with a string `type` (422 otherwise); accepted, not applied."""
    if raw is None:
        return
    if not isinstance(raw, list) or not all(isinstance(s, dict) and isinstance(s.get("type"), str) for s in raw):
        raise ValidationError("'safeguards' must be an array of objects with a string 'type'", param="safeguards")


def _output_config(raw: Any, out: dict[str, Any]) -> str | None:
    """`output_config.format` {type: json_schema, schema} is structured output: the reply's text
    is held to the schema by the same constrained decoding as OpenAI's `response_format`. Returns
    `effort` (a level for the template, server/effort.py; a hint where the template has none)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValidationError("'output_config' must be an object", param="output_config")
    for key in raw:
        if key not in ("format", "effort"):
            raise InvalidRequestError(f"'output_config.{key}' is not supported by this server", param="output_config")
    effort = parse_effort(raw.get("effort"), "output_config.effort")
    fmt = raw.get("format")
    if fmt is None:
        return effort
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValidationError(
            "'output_config.format' must be {type: json_schema, schema: {...}}", param="output_config"
        )
    if set(fmt) - {"type", "schema"}:
        raise InvalidRequestError(
            f"'output_config.format.{sorted(set(fmt) - {'type', 'schema'})[0]}' is not supported by this server",
            param="output_config",
        )
    out["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True},
    }
    return effort


def thinking_wanted(body: dict[str, Any]) -> bool:
    """Whether the request asks for thinking, with Anthropic's semantics: `enabled` or `adaptive` on,
    `disabled` or no `thinking` field off. It sets the template's enable_thinking; with it off, a
    reply's thinking is not returned even if the model writes some. `budget_tokens` is checked, not
    enforced apart: max_tokens bounds thinking and text together."""
    raw = body.get("thinking")
    if raw is None:
        return False
    if not isinstance(raw, dict) or raw.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValidationError("'thinking' must be {type: enabled | disabled | adaptive}", param="thinking")
    budget = raw.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValidationError("'thinking.budget_tokens' must be a positive integer", param="thinking")
    if not isinstance(raw.get("display", ""), str):  # how Anthropic shows thinking ("summarized", "omitted")
        raise ValidationError("'thinking.display' must be a string", param="thinking")
    return raw["type"] != "disabled"
