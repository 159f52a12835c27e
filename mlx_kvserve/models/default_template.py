"""The default model's chat template with tools. SmolLM2's own template is plain ChatML and has no
tools, so an agent client (Claude Code, Codex, …) got `tools_not_supported` from `make run`'s server.
This one renders exactly SmolLM2's prompt when a request has no tools and no tool turns (the cache and
every answer stay as they were), and offers tools the way Qwen2.5 and Hermes do: their JSON schemas
in the system turn, calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results as
`<tool_response>` in a user turn. mlx-lm picks its `json_tools` parser from those markers.

A 135M model calls tools poorly; the protocol and the cache are what this makes real.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)

TOOL_TEMPLATE = (
    # The system turn: the request's own or SmolLM2's default, then the tools when there are any.
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '" + DEFAULT_SYSTEM + "' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '" + TOOLS_INTRO.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '" + TOOLS_OUTRO.replace("\n", "\\n") + "' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    # Consecutive tool results share one user turn, each in <tool_response> tags.
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    # As Qwen2.5 renders it, so the history reads as the model wrote it after `assistant\n`.
    "{{- '<|im_start|>assistant' }}{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def install_tool_template(folder: Path) -> None:
    """Put TOOL_TEMPLATE into the converted default model's tokenizer_config.json (a folder this
    package wrote), once: a folder converted before the template existed gets it on its next load."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("chat_template") == TOOL_TEMPLATE:
        return
    config["chat_template"] = TOOL_TEMPLATE
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(config, indent=2))
    partial.replace(path)
