"""Grammars that hold a model to its tool-call format, written in llguidance's Lark syntax.

- `tool_choice` "required" or a named function: the reply is calls only, each `{"name": ...,
  "arguments": ...}` valid against its tool's schema read strictly (`closed`), and nothing after the
  last one but end of sequence. A named function gets exactly one call; "required" one, or several
  when parallel calls are allowed.
- "auto" with a `strict` tool or a `response_format`: the model still chooses; a call, once begun,
  follows its tool's schema, and a plain answer follows the response format.

A thinking model may reason first: a reasoning block the prompt leaves open (or one the model
opens) is free text until its end marker. The call format is mlx-lm's, found from the chat
template; its text is read from formats/tool_calls.py. json_tools (JSON between markers: Qwen2.5/Qwen3,
Hermes and the like) and qwen3_coder (XML-style parameters: Qwen3-Coder, Qwen3.5) are served; for the
others a forced choice is refused with the format's name, never faked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...formats.reasoning import reasoning_state
from ...formats.tool_calls import JSON_CALL, JSON_TOOLS, QWEN3_CODER, XML_FUNCTION, XML_PARAMETER, format_name

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


def check_format(tokenizer: Any) -> None:
    """UnsupportedCallFormat unless calls of this model can be constrained."""
    name = format_name(tokenizer)
    if name not in CALL_BODIES:
        raise UnsupportedCallFormat(
            f"this model's tool-call format ({name or 'none'}) cannot be constrained here; "
            f"supported: {', '.join(CALL_BODIES)}"
        )


def _special(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one special token of the vocabulary (llguidance keeps special
    tokens out of text, so free text can never contain one)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    for token_id, added in (getattr(inner, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False) and getattr(added, "content", None) == text:
            return int(token_id)
    return None


def _lark(*parts: str) -> str:
    """A Lark string of the format's text `parts` (names inside it are written as given)."""
    return '"' + "".join(p.replace("\n", "\\n") for p in parts) + '"'


def _literal(tokenizer: Any, text: str) -> str:
    """`text` as a Lark item: the special token itself, or the string."""
    token = _special(tokenizer, text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _functions(spec: CallGrammar) -> list[dict[str, Any]]:
    functions = [t["function"] for t in spec.tools if spec.name is None or t["function"]["name"] == spec.name]
    if not functions:
        raise UnsupportedCallFormat(f"no tool named {spec.name!r}")
    return functions


def _held(spec: CallGrammar, fn: dict[str, Any]) -> bool:
    """Whether `fn`'s arguments must follow its schema (else: any object)."""
    return spec.forced or fn["name"] in spec.strict_names


# Keywords whose value is one subschema, a list of them, or a map of them: `closed` walks these.
_ONE, _LIST, _MAP = ("items", "additionalProperties"), ("prefixItems", "anyOf", "oneOf"), ("properties", "$defs")


def closed(schema: Any, close: bool = True) -> Any:
    """`schema` read strictly, as OpenAI's strict mode and every constrained-decoding library offer:
    an object that names its `properties` and says nothing of other keys gets `additionalProperties:
    false` (else a weak model invents keys until max_tokens). A free-form object (no `properties`)
    stays open, its only way to carry data. With `allOf` the properties add up across branches, so
    neither the branches nor their parent are closed, only what lies inside them; `not` and `if` are
    left as written."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in (*_MAP, "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(s, close=False) for s in out["allOf"]]
        close = False
    if close and "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_schema(fn: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The JSON of one call of `fn`: its name, and arguments valid against its schema read strictly
    (`closed`; no `parameters`: no arguments, as in OpenAI's API), or any object when not strict."""
    arguments = closed(fn.get("parameters") or {"type": "object", "properties": {}}) if strict else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_call_body(spec: CallGrammar) -> list[str]:
    """json_tools: `\n{"name": ..., "arguments": {...}}\n` between the markers."""
    options = [call_schema(fn, _held(spec, fn)) for fn in _functions(spec)]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), **COMPACT}
    return [f"body: {_lark(JSON_CALL[0])} %json {json.dumps(schema)} {_lark(JSON_CALL[1])}"]


# qwen3_coder parameter values: strings are raw text, everything else JSON text (the template's tojson).
_RAW_STRING_KEYS = {"type", "enum", "const", "description", "title", "default", "examples"}


def _xml_value(name: str, schema: dict[str, Any], rule: str) -> list[str]:
    """Rules for one parameter's value, ending with its closing tag."""
    end = _lark(XML_PARAMETER.close)
    if schema.get("type") == "string":
        extra = sorted(set(schema) - _RAW_STRING_KEYS)
        if extra:
            raise UnsupportedCallFormat(
                f"parameter {name!r}: {', '.join(extra)} cannot be enforced on raw-text values (qwen3_coder format)"
            )
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if values is not None:
            return [f"{rule}: ({' | '.join(json.dumps(str(v)) for v in values)}) {end}"]
        return [f"{rule}[lazy]: /(.|\\n)*/ {end}"]  # ends at the first closing tag, as the parser reads it
    if isinstance(schema.get("type"), list):
        raise UnsupportedCallFormat(f"parameter {name!r}: a list of types cannot be told apart in raw text")
    return [f"{rule}: %json {json.dumps({**closed(schema), **COMPACT})} {end}"]


def _xml_call_body(spec: CallGrammar) -> list[str]:
    """qwen3_coder: `\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n`;
    a held call has its schema's properties in order, the required ones always."""
    rules, options = [], []
    for i, fn in enumerate(_functions(spec)):
        params = fn.get("parameters") or {}
        parts = []
        if _held(spec, fn):
            required = set(params.get("required", []))
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                rule = f"v{i}_{j}"
                rules += _xml_value(key, schema if isinstance(schema, dict) else {}, rule)
                item = f"{_lark(XML_PARAMETER.open, key, XML_PARAMETER.name_end)} {rule}"
                parts.append(item if key in required else f"({item})?")
        else:
            head = f"{_lark(XML_PARAMETER.open)} /[^>\\n]+/ {_lark(XML_PARAMETER.name_end)}"
            rules.append(f"any_param[lazy]: {head} /(.|\\n)*/ {_lark(XML_PARAMETER.close)}")
            parts.append("any_param*")
        rules.append(f"f{i}: {_lark(fn['name'], XML_FUNCTION.name_end)} {' '.join(parts)}")
        options.append(f"f{i}")
    return [f"body: {_lark(XML_FUNCTION.open)} ({' | '.join(options)}) {_lark(XML_FUNCTION.close)}", *rules]


CALL_BODIES = {JSON_TOOLS: _json_call_body, QWEN3_CODER: _xml_call_body}


def build(tokenizer: Any, prompt: Sequence[int], spec: CallGrammar) -> str:
    """The Lark grammar of a reply under `spec` (UnsupportedCallFormat when the model's format has none)."""
    check_format(tokenizer)
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    rules = ["%llguidance {}", *_reasoning_rules(tokenizer, prompt), *CALL_BODIES[format_name(tokenizer)](spec)]
    # A named function is one call, parallel calls allowed or not (OpenAI and Anthropic return one).
    more = " (/\\n?/ call)*" if spec.parallel and not (spec.forced and spec.name) else ""
    marked = f"{_literal(tokenizer, start)} body {_literal(tokenizer, end)}"
    if spec.forced:
        rules += [f"start: reasoning call{more}", f"call: {marked}"]
    elif spec.answer_schema is not None:  # a JSON answer, or calls
        rules += [f"start: reasoning (answer | call{more})", f"call: {marked}"]
        rules.append(f"answer: %json {json.dumps({**spec.answer_schema, **COMPACT})}")
    else:  # free text; a call is held to its schema from its start marker on
        rules += ["start: reasoning " + ("call* " if spec.parallel else "call? ") + "TAIL", "TAIL: /(.|\\n)*/"]
        if _special(tokenizer, start) is not None:  # a special marker never occurs inside text
            rules.append(f"call: /(.|\\n)*/ {marked}")
        else:  # text up to the first marker, then the call
            rules.append(f"call: head body {_literal(tokenizer, end)}")
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
