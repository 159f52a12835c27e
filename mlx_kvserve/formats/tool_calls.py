"""Tool calls as text: the tools a request offers (ToolSpec), the markers a model writes a call
between, the call syntax of the formats a grammar can hold a reply to, and the text between the markers
parsed by mlx-lm's own parser for that model (the tokenizer's `tool_parser`, chosen by mlx-lm from the
chat template or vocabulary). No parser is written here.

`tool_choice` "required", a named function and `strict` tools are enforced by constrained decoding
(engine/sampling/tool_grammar.py builds the grammar from the call syntax below); the request's `tools` and
`tool_choice` are read by server/openai/tools.py.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError

log = logging.getLogger(__name__)

# The call formats a grammar can hold a reply to (mlx-lm's parser module names), and their text between
# the markers, as mlx-lm's parser for the format reads it.
JSON_TOOLS = "json_tools"  # `\n{"name": ..., "arguments": {...}}\n`: Qwen2.5/Qwen3, Hermes and the like
QWEN3_CODER = "qwen3_coder"  # `\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n`
JSON_CALL = ("\n", "\n")  # json_tools: the text before and after the call's JSON


@dataclass(frozen=True)
class Tag:
    """An XML-style tag of qwen3_coder: `open` NAME `name_end` ... `close`."""

    open: str
    name_end: str
    close: str


XML_FUNCTION = Tag("\n<function=", ">\n", "</function>\n")
XML_PARAMETER = Tag("<parameter=", ">\n", "\n</parameter>\n")  # the value: raw text for strings, else JSON


def format_name(tokenizer: Any) -> str:
    """mlx-lm's parser module for this tokenizer ("" when it has no tool calling)."""
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] if parser is not None else ""


@dataclass(frozen=True)
class ToolSpec:
    """The tools a request offers. `tools` go to the chat template as given (OpenAI's shape);
    `choice` is "auto" (calls are parsed out of the reply), "required" (the reply is calls, of the
    function `name` when given) or "none" (tools are still rendered, so the prompt and its cached
    prefix stay the same, but the reply is returned as plain text)."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    parallel: bool = True
    name: str | None = None  # tool_choice naming one function

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def strict_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools if t["function"].get("strict"))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:  # streamed deltas carry the call's position
            out["index"] = index
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def check_support(tokenizer: Any, spec: ToolSpec | None, param: str = "tools") -> None:
    """InvalidRequestError when tools are offered to a model whose tokenizer has no tool-call
    markers: the model was not trained to call tools, and its template would drop them."""
    if spec and spec.tools and not getattr(tokenizer, "has_tool_calling", False):
        raise InvalidRequestError(
            "this model does not support tool calling (mlx-lm found no tool-call format in its chat template)",
            param=param,
            code="tools_not_supported",
        )


def markers(tokenizer: Any) -> tuple[str, str] | None:
    """The (start, end) strings around one tool call in the model's output, or None."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    return tokenizer.tool_call_start, tokenizer.tool_call_end


def parse_tool_call(tokenizer: Any, text: str, tools: list[dict[str, Any]]) -> list[ToolCall] | None:
    """The calls in `text` (what the model wrote between one pair of markers), read by mlx-lm's
    parser for this model; None when the parser cannot read it (a call cut short by max_tokens, or
    invalid JSON from the model), so the caller can return the text instead of losing it."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
        log.info("model wrote a tool call its parser cannot read (%s: %s)", type(exc).__name__, exc)
        return None
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):  # arguments are an object, in both APIs
            return None
        calls.append(ToolCall(id=new_call_id(), name=item["name"], arguments=json.dumps(args, ensure_ascii=False)))
    return calls
