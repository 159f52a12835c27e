"""Tool calling: the request's `tools` / `tool_choice` checked, and the text a model writes between
its tool-call markers parsed by mlx-lm's own parser for that model (the tokenizer's `tool_parser`,
chosen by mlx-lm from the chat template or vocabulary). No parser is written here.

`tool_choice` "required", a named function and `strict` tools are enforced by constrained decoding
(engine/tool_grammar.py): the reply is held to the model's call format and each tool's schema.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.tool_grammar import CallGrammar
from ..errors import InvalidRequestError, ValidationError

log = logging.getLogger(__name__)


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


def call_grammar(spec: ToolSpec | None, answer_schema: dict[str, Any] | None) -> CallGrammar | None:
    """What the reply must be held to for these tools and this response format; None when tool
    calls need no grammar (the response format alone, if any, is enforced as a JSON schema)."""
    if spec is None or not spec.parses_calls:
        return None
    forced = spec.choice == "required"
    if forced and answer_schema is not None:
        raise InvalidRequestError(
            "'response_format' cannot apply to a reply that must be a tool call ('tool_choice')",
            param="response_format",
        )
    if not forced and not spec.strict_names and answer_schema is None:
        return None
    return CallGrammar(tuple(spec.tools), forced, spec.name, spec.parallel, spec.strict_names, answer_schema)


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


def check_function(fn: Any, where: str, param: str) -> dict[str, Any]:
    """A function definition {name, description?, parameters?} checked (ValidationError naming `where`)."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValidationError(f"{where} must be an object with a non-empty string 'name'", param=param)
    if not isinstance(fn.get("description", ""), str):
        raise ValidationError(f"{where}.description must be a string", param=param)
    if not isinstance(fn.get("parameters", {}), dict):
        raise ValidationError(f"{where}.parameters must be a JSON Schema object", param=param)
    if not isinstance(fn.get("strict", False), bool | None):
        raise ValidationError(f"{where}.strict must be a boolean", param=param)
    return fn


def parse_openai_tools(body: dict[str, Any]) -> ToolSpec | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of an OpenAI chat request; None when it
    offers no tools. ValidationError for wrong shapes, InvalidRequestError for choices not served."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise ValidationError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise ValidationError("'tools' must be an array of function tools", param="tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValidationError(f"tools[{i}] must be an object with type 'function'", param="tools")
        check_function(tool.get("function"), f"tools[{i}].function", "tools")
    if choice is None:
        choice = "auto"
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValidationError("a named 'tool_choice' is {type: 'function', function: {name}}", param="tool_choice")
        choice, name = "required", fn["name"]
    if choice not in ("auto", "none", "required"):
        raise ValidationError("'tool_choice' must be 'auto', 'none', 'required' or a function", param="tool_choice")
    return named_spec(raw, choice, name, parallel is not False)


def named_spec(tools: list[dict[str, Any]], choice: str, name: str | None, parallel: bool) -> ToolSpec:
    """A ToolSpec, with a 400 when `name` is not one of the tools."""
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(f"'tool_choice' names {name!r}, which is not in 'tools'", param="tool_choice")
    return ToolSpec(tools=tools, choice=choice, parallel=parallel, name=name)


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
