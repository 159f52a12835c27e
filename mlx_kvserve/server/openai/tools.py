"""The `tools`, `tool_choice` and `parallel_tool_calls` of a chat request checked into a ToolSpec
(formats/tool_calls.py), and what a reply must be held to for them: `tool_choice` "required", a named
function and `strict` tools are enforced by constrained decoding (engine/sampling/tool_grammar.py)."""

from __future__ import annotations

from typing import Any

from ...engine.sampling.tool_grammar import CallGrammar
from ...errors import InvalidRequestError, ValidationError
from ...formats.tool_calls import ToolSpec


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
