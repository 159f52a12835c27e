"""The OpenAI Responses API request: a `POST /v1/responses` body translated into the OpenAI chat body
that serves it, so it goes through the same parsing, chat template, engine and block cache as
`/v1/chat/completions` (the reply's shape is in reply.py, the routes in routes.py).

Input items map to chat messages: `message` items by role (`developer` rendered as `system`),
`function_call` items to an assistant message's `tool_calls`, `function_call_output` items to `tool`
messages, `reasoning` items to the next assistant message's `reasoning_content`. Function tools (the
flat Responses shape) become chat tools; tool types this server cannot run (`web_search`,
`file_search`, `namespace`, `custom`, ...) are accepted and not offered to the model. Pure functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidRequestError, KVServeError, ValidationError
from ..context_window import ContextLengthError
from ..keep_alive import parse_keep_alive

# Served as asked.
SERVED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens"}
SERVED |= {"temperature", "top_p", "reasoning", "text", "stream", "store", "previous_response_id", "top_k"}
SERVED |= {"keep_alive"}  # Ollama's: how long the model stays loaded (server/keep_alive.py)
SERVED |= {"prompt_cache_key"}  # a cache hint: leases the prompt's prefix (responses/routes.py)
# Accepted: they name the caller or a hosted service's option and carry no meaning for the answer here.
ACCEPTED = {"metadata", "user", "service_tier", "include", "truncation", "safety_identifier"}
ACCEPTED |= {"prompt_cache_retention", "stream_options", "client_metadata"}
# Accepted only at the value that asks for nothing.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = (None, "auto", "concise", "detailed")
TEXT_PARTS = ("input_text", "output_text", "text")
# Chat-side names of a field, as the Responses API names it, for the errors of the shared chat path.
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A parsed Responses request: the chat body that serves it and what the reply echoes or keeps."""

    chat: dict[str, Any]  # the OpenAI chat body (parsed by server/openai/parse.py)
    items: list[dict[str, Any]]  # the conversation's input items: stored history, then this input
    store: bool
    previous_response_id: str | None
    prompt_cache_key: str | None  # a client's "cache this prompt": its prefix is leased (responses/routes.py)
    summary: bool  # reasoning goes in the item's `summary` (asked for) rather than its `content`
    echo: dict[str, Any]  # request fields the Response object repeats


def previous_id(body: Any) -> str | None:
    """The `previous_response_id` of a body (checked), to look up its history before parsing."""
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if prev is not None and not isinstance(prev, str):
        raise ValidationError("'previous_response_id' must be a string", param="previous_response_id")
    return prev


def parse(body: Any, history: list[dict[str, Any]]) -> ResponsesRequest:
    """The request in `body`, continuing the conversation `history` (the items of the response
    named by `previous_response_id`, [] without one). ValidationError (422) for wrong shapes,
    InvalidRequestError (400) for fields or items this server cannot serve; each names the field."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    _check_fields(body)
    new_items = _input_items(body.get("input"))
    items = history + new_items
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValidationError("'instructions' must be a string", param="instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + to_messages(
        items, len(history)
    )
    chat: dict[str, Any] = {"messages": _merge_leading_system(messages)}
    for name in ("model", "stream", "temperature", "top_p", "top_k", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    _tools(body, chat)
    _text_format(body.get("text"), chat)
    summary = _reasoning(body.get("reasoning"), chat)
    store = body.get("store", True)
    if not isinstance(store, bool | None):
        raise ValidationError("'store' must be a boolean", param="store")
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "metadata", "user", "prompt_cache_key")}
    echo |= {k: body.get(k) for k in ("previous_response_id", "safety_identifier", "temperature", "top_p")}
    echo |= {"tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto"}
    echo |= {"parallel_tool_calls": body.get("parallel_tool_calls") is not False, "store": store is not False}
    echo |= {"reasoning": body.get("reasoning"), "text": body.get("text") or {"format": {"type": "text"}}}
    echo |= {"truncation": body.get("truncation") or "disabled", "service_tier": body.get("service_tier") or "default"}
    key = body.get("prompt_cache_key")
    return ResponsesRequest(chat, items, store is not False, body.get("previous_response_id"), key, summary, echo)


def renamed(exc: KVServeError) -> KVServeError:
    """`exc` from the shared chat path, naming the field as the Responses API names it (and a prompt
    past the context in the Responses API's words)."""
    if isinstance(exc, ContextLengthError):
        exc.message = exc.responses_message()
    if exc.param in RENAMED:
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{RENAMED[exc.param]}'")
        exc.param = RENAMED[exc.param]
    return exc


# --- fields -------------------------------------------------------------------------------------------


def _check_fields(body: dict[str, Any]) -> None:
    parse_keep_alive(body.get("keep_alive"))
    for name, value in body.items():
        if name in SERVED or name in ACCEPTED:
            continue
        if name in NEUTRAL and any(value == v and type(value) is type(v) for v in NEUTRAL[name]):
            continue
        what = "is not supported by this server" if name in NEUTRAL else "is not a field this server knows"
        raise InvalidRequestError(f"'{name}' {what}", param=name, code="unsupported_field")
    if not isinstance(body.get("metadata") or {}, dict):
        raise ValidationError("'metadata' must be an object", param="metadata")
    if not isinstance(body.get("prompt_cache_key", ""), str | None):
        raise ValidationError("'prompt_cache_key' must be a string", param="prompt_cache_key")
    if not isinstance(body.get("include") or [], list):
        raise ValidationError("'include' must be an array", param="include")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise ValidationError("'truncation' must be 'auto' or 'disabled'", param="truncation")
    value = body.get("max_output_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValidationError("'max_output_tokens' must be a positive integer", param="max_output_tokens")


def _input_items(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw or not all(isinstance(item, dict) for item in raw):
        raise ValidationError("'input' must be a string or a non-empty array of items", param="input")
    return raw


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Function tools in the chat shape; other tool types are not offered to the model."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise ValidationError("'tools' must be an array", param="tools")
    functions = []
    for i, tool in enumerate(raw or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise ValidationError(f"tools[{i}] must be an object with a 'type'", param="tools")
        if tool["type"] != "function":
            continue  # a hosted tool (web_search, file_search, namespace...): nothing here can run it
        fn = {"name": tool.get("name")}  # chat's key order: the same tool renders as the same text
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("parameters") or {}
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        functions.append({"type": "function", "function": fn})
    if functions:
        chat["tools"] = functions
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequestError(
                f"'tool_choice' {{type: {choice.get('type')!r}}} names a tool this server cannot run; "
                "use 'auto', 'none', 'required' or {type: 'function', name}",
                param="tool_choice",
            )
        if not isinstance(choice.get("name"), str):
            raise ValidationError("'tool_choice' {type: 'function'} needs a 'name'", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice


def _text_format(raw: Any, chat: dict[str, Any]) -> None:
    """`text.format` as chat's `response_format` (held by the same constrained decoding)."""
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise ValidationError("'text' must be an object", param="text")
    fmt = raw.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ValidationError("'text.format.type' must be 'text', 'json_object' or 'json_schema'", param="text.format")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValidationError("'text.format' json_schema needs a 'schema' object", param="text.format")
        spec = {"name": fmt.get("name") or "output", "schema": fmt["schema"], "strict": fmt.get("strict")}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        chat["response_format"] = {"type": fmt["type"]}


def _reasoning(raw: Any, chat: dict[str, Any]) -> bool:
    """`reasoning.effort` through the template's thinking control ('none' turns thinking off, any
    other effort on; absent leaves the template's default). True when a summary is asked for."""
    if raw is None:
        return False
    if not isinstance(raw, dict):
        raise ValidationError("'reasoning' must be an object", param="reasoning")
    effort, summary = raw.get("effort"), raw.get("summary") or raw.get("generate_summary")
    if effort not in EFFORTS:
        raise ValidationError(
            f"'reasoning.effort' must be one of {', '.join(map(str, EFFORTS[1:]))}", param="reasoning"
        )
    if summary not in SUMMARIES:
        raise ValidationError("'reasoning.summary' must be 'auto', 'concise' or 'detailed'", param="reasoning")
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    return summary is not None


# --- input items --------------------------------------------------------------------------------------


def _text(content: Any, where: str, images: bool = False) -> Any:
    """A message's content: a string or text parts (input_text / output_text); with `images`, an
    input_image part makes it OpenAI content parts (text and image_url, in order)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"{where}.content must be a string or an array of parts", param="input")
    parts: list[Any] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ValidationError(f"{where}.content[{j}].image_url must be a string (a data URL)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}, "where": f"{where}.content[{j}]"})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in TEXT_PARTS or kind is None:
            raise ValidationError(f"{where}.content[{j}] must be a text part with a string 'text'", param="input")
        else:
            raise InvalidRequestError(
                f"{where}.content[{j}]: content type {kind!r} is not supported by this server", param="input"
            )
    if any(isinstance(p, dict) for p in parts):
        return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return "".join(parts)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
        raise ValidationError(f"{where} needs a string 'name' and 'call_id'", param="input")
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise ValidationError(f"{where}.arguments must be a JSON string", param="input")
    try:
        decoded = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        raise ValidationError(f"{where}.arguments is not valid JSON", param="input") from None
    if not isinstance(decoded, dict):
        raise ValidationError(f"{where}.arguments must be a JSON object", param="input")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []  # the raw text when given, else its summary
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def to_messages(items: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """Chat messages for `items`; items before `first` are stored history, so error messages count
    this request's `input` from `first`."""
    out: list[dict[str, Any]] = []
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they belong to

    def assistant(content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
            thinking.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where, kind = f"input[{i - first}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValidationError(f"{where}.role must be user, assistant, system or developer", param="input")
            text = _text(item.get("content"), where, images=role == "user")
            if role == "assistant":
                assistant(text)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out and out[-1]["role"] == "assistant" and not thinking else assistant("")
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValidationError(f"{where}.call_id must be a string", param="input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            thinking.append(_reasoning_text(item))
        else:
            raise InvalidRequestError(f"{where}: item type {kind!r} is not supported by this server", param="input")
    if not out:
        raise ValidationError("'input' holds no message", param="input")
    return out


def _merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`instructions` and leading developer / system items as one system message: many chat
    templates take a single system message, first."""
    num = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if num < 2:
        return messages
    merged = {"role": "system", "content": "\n\n".join(m["content"] for m in messages[:num])}
    return [merged, *messages[num:]]
