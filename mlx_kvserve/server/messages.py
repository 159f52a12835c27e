"""OpenAI chat messages checked and put in the shape chat templates take. Pure functions."""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequestError, ValidationError
from ..vision.images import ImageRef

ROLES = ("system", "developer", "user", "assistant", "tool")


def check_text(text: str, param: str) -> str:
    """`text`, unless it holds a lone surrogate (a JSON escape like "\\ud800" with no pair), which is
    not Unicode text and which no tokenizer takes: then InvalidRequestError (400) naming `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidRequestError(
            f"'{param}' holds a lone surrogate (\\u{code:04x} at character {exc.start}), which is not valid Unicode text",
            param=param,
        ) from None
    return text


IMAGE_MARK = "\ue000"  # stands for an image part in a message's text (vision/runtime.py expands it)
IMAGES_KEY = "_images"  # a parsed message's image parts (ImageRef), taken out by take_images


def _content_text(content: Any, where: str, images: list[ImageRef] | None = None) -> str:
    """The text of a message's content; with `images`, each `image_url` part becomes IMAGE_MARK in
    the text and its ImageRef is appended to `images`."""
    if isinstance(content, str):
        return check_text(content, f"{where}.content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if images is not None and isinstance(part, dict) and part.get("type") == "image_url":
                images.append(_image_ref(part, f"{where}.content[{i}]"))
                parts.append(IMAGE_MARK)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValidationError(
                    f"{where}.content[{i}] must be a text or image_url part", param=f"{where}.content"
                )
            parts.append(part["text"])
        return check_text("".join(parts), f"{where}.content")
    raise ValidationError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with each call's `arguments` decoded from its JSON text
    into an object, as chat templates (and mlx-lm's server) expect."""
    if not isinstance(raw, list):
        raise ValidationError(f"{where}.tool_calls must be an array", param="messages")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValidationError(f"{at} must be a function call with a 'name'", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ValidationError(f"{at}.function.arguments is not valid JSON", param="messages") from None
        if not isinstance(args, dict):
            raise ValidationError(f"{at}.function.arguments must be a JSON object", param="messages")
        calls.append(
            {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return calls


def _parse_message(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ValidationError(f"{where} must be an object", param="messages")
    role = msg.get("role")
    if role not in ROLES:
        raise ValidationError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
    content = msg.get("content")
    if content is None and role == "assistant":
        content = ""
    images: list[ImageRef] = []
    out: dict[str, Any] = {"role": role, "content": _content_text(content, where, images)}
    if images:
        out[IMAGES_KEY] = images
    if role == "assistant" and msg.get("tool_calls"):
        out["tool_calls"] = _tool_calls(msg["tool_calls"], where)
    if role == "assistant" and msg.get("reasoning_content") is not None:
        out["reasoning_content"] = _content_text(msg["reasoning_content"], f"{where}.reasoning")
    for key in ("tool_call_id", "name"):  # a tool result names the call it answers
        if msg.get(key) is not None:
            if not isinstance(msg[key], str):
                raise ValidationError(f"{where}.{key} must be a string", param="messages")
            out[key] = msg[key]
    return out


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role and text content, plus an assistant's
    `tool_calls` / `reasoning_content` and a tool message's `tool_call_id` / `name`."""
    if not isinstance(raw, list) or not raw:
        raise ValidationError("'messages' must be a non-empty array", param="messages")
    return [_parse_message(msg, f"messages[{i}]") for i, msg in enumerate(raw)]


def _image_ref(part: dict[str, Any], where: str) -> ImageRef:
    """An OpenAI image_url part: {"type": "image_url", "image_url": {"url": ...}} (or the URL as a string)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise ValidationError(
            f"{where}.image_url.url must be a string (a data URL or http(s))", param=where.rpartition("[")[0]
        )
    named = part.get("where")  # set by the Anthropic and Responses parsers: the part in their request
    return ImageRef(url, named if isinstance(named, str) else where)


def take_images(messages: list[dict[str, Any]]) -> tuple[ImageRef, ...]:
    """The image parts of parsed messages, in order, removed from them (templates never see them)."""
    return tuple(ref for msg in messages for ref in msg.pop(IMAGES_KEY, ()))


def merge_system_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that takes system messages only first (Qwen's and others raise
    otherwise): a later system message's text goes at the head of the next user message, as templates
    without a system role do with the system prompt, or at the end of the last one before it when no
    user message follows. Returns `messages` itself when there is nothing to merge."""
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if all(m["role"] != "system" for m in messages[lead:]):
        return messages
    out, pending = [dict(m) for m in messages[:lead]], []
    for msg in messages[lead:]:
        if msg["role"] == "system":
            pending.append(msg["content"])
        elif msg["role"] == "user" and pending:
            out.append({**msg, "content": "\n\n".join([*pending, msg["content"]])})
            pending = []
        else:
            out.append(msg)
    if pending:
        last = next((i for i in range(len(out) - 1, -1, -1) if out[i]["role"] == "user"), None)
        if last is None:
            out.append({"role": "user", "content": "\n\n".join(pending)})
        else:
            out[last] = {**out[last], "content": "\n\n".join([out[last]["content"], *pending])}
    return out
