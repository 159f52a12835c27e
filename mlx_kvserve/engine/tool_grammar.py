"""Grammars that hold a model to its tool-call format, written in llguidance's Lark syntax.

- `tool_choice` "required" or a named function: the reply is one call (or several, when parallel
  calls are allowed), each `{"name": ..., "arguments": ...}` valid against its tool's schema.
- "auto" with a `strict` tool or a `response_format`: the model still chooses; a call, once begun,
  follows its tool's schema, and a plain answer follows the response format.

A thinking model may reason first: a reasoning block the prompt leaves open (or one the model
opens) is free text until its end marker. The call format is mlx-lm's, found from the chat
template: the formats whose calls are JSON between two markers (json_tools: Qwen, Hermes and the
like) are served; for the others a forced choice is refused with the format's name, never faked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

JSON_CALL_FORMATS = ("json_tools",)  # mlx-lm parsers that read {"name", "arguments"} between markers
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # no blank padding from weak models


class UnsupportedCallFormat(ValueError):
    """The model's tool-call format has no grammar here."""


@dataclass(frozen=True)
class CallGrammar:
    """What to build: `forced` True makes the reply calls only; `name` restricts them to one function;
    `strict_names` are the tools whose arguments must follow their schema under "auto" (all tools
    when forced); `answer_schema` is the response format of a plain answer (None: free text)."""

    tools: tuple[dict[str, Any], ...]  # OpenAI function tools
    forced: bool = False
    name: str | None = None
    parallel: bool = True
    strict_names: frozenset[str] = frozenset()
    answer_schema: dict[str, Any] | None = None


def format_name(tokenizer: Any) -> str:
    """mlx-lm's parser module for this tokenizer ("" when it has no tool calling)."""
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] if parser is not None else ""


def check_format(tokenizer: Any) -> None:
    """UnsupportedCallFormat unless calls of this model can be constrained."""
    name = format_name(tokenizer)
    if name not in JSON_CALL_FORMATS:
        raise UnsupportedCallFormat(
            f"this model's tool-call format ({name or 'none'}) cannot be constrained here; "
            f"supported: {', '.join(JSON_CALL_FORMATS)}"
        )


def reasoning_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """ "open": the prompt ends inside a reasoning block (a template that opens `<think>`);
    "closed": it ends right after one (a template that turns thinking off with an empty block);
    "free": the model may open one; "none": the model has no reasoning markers."""
    if not getattr(tokenizer, "has_thinking", False):
        return "none"
    opened, closed = tokenizer.rfind_think_start(prompt), tokenizer.rfind_think_end(prompt)
    if opened >= 0 and opened > closed:
        return "open"
    if closed >= 0 and not tokenizer.decode(list(prompt[closed + 1 :])).strip():
        return "closed"
    return "free"


def _special(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one special token of the vocabulary (llguidance keeps special
    tokens out of text, so free text can never contain one)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    for token_id, added in (getattr(inner, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False) and getattr(added, "content", None) == text:
            return int(token_id)
    return None


def _literal(tokenizer: Any, text: str) -> str:
    """`text` as a Lark item: the special token itself, or the string."""
    token = _special(tokenizer, text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def call_schema(fn: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The JSON of one call of `fn`: its name, and arguments valid against its schema (any object
    when not strict)."""
    arguments = (fn.get("parameters") or {"type": "object"}) if strict else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _calls_schema(spec: CallGrammar) -> dict[str, Any]:
    functions = [t["function"] for t in spec.tools if spec.name is None or t["function"]["name"] == spec.name]
    if not functions:
        raise UnsupportedCallFormat(f"no tool named {spec.name!r}")
    options = [call_schema(fn, spec.forced or fn["name"] in spec.strict_names) for fn in functions]
    return {**(options[0] if len(options) == 1 else {"anyOf": options}), **COMPACT}


def build(tokenizer: Any, prompt: Sequence[int], spec: CallGrammar) -> str:
    """The Lark grammar of a reply under `spec` (UnsupportedCallFormat when the model's format has none)."""
    check_format(tokenizer)
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    body = f'"\\n" %json {json.dumps(_calls_schema(spec))} "\\n" {_literal(tokenizer, end)}'
    rules = ["%llguidance {}"] + _reasoning_rules(tokenizer, prompt)
    if spec.forced:
        rules.append("start: reasoning call" + (" (/\\n?/ call)*" if spec.parallel else ""))
        rules.append(f"call: {_literal(tokenizer, start)} {body}")
    elif spec.answer_schema is not None:  # a JSON answer, or calls
        rules.append("start: reasoning (answer | call" + (" (/\\n?/ call)*)" if spec.parallel else ")"))
        rules.append(f"answer: %json {json.dumps({**spec.answer_schema, **COMPACT})}")
        rules.append(f"call: {_literal(tokenizer, start)} {body}")
    else:  # free text; a call is held to its schema from its start marker on
        rules.append("start: reasoning " + ("call* " if spec.parallel else "call? ") + "TAIL")
        rules.append("TAIL: /(.|\\n)*/")
        if _special(tokenizer, start) is not None:  # a special marker never occurs inside text
            rules.append(f"call: /(.|\\n)*/ {_literal(tokenizer, start)} {body}")
        else:  # text up to the first marker, then the call
            rules.append(f"call: head {body}")
            rules.append(f"head[lazy]: /(.|\\n)*/ {_literal(tokenizer, start)}")
    return "\n".join(rules) + "\n"


def _reasoning_rules(tokenizer: Any, prompt: Sequence[int]) -> list[str]:
    """`reasoning`: the end of a block the prompt opened, an optional block the model opens, or nothing."""
    state = reasoning_state(tokenizer, prompt)
    if state in ("none", "closed"):
        return ["reasoning: "]
    closing = _literal(tokenizer, tokenizer.think_end)
    if _special(tokenizer, tokenizer.think_end) is not None:
        rules = [f"thought: /(.|\\n)*/ {closing} /\\n*/"]
    else:
        rules = ["thought: thought_text /\\n*/", f"thought_text[lazy]: /(.|\\n)*/ {closing}"]
    if state == "open":
        return ["reasoning: thought", *rules]
    return [f"reasoning: ({_literal(tokenizer, tokenizer.think_start)} thought)?", *rules]
