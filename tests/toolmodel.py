"""A tiny random-weight model whose tokenizer declares tool calling and thinking, built locally.

The byte tokenizer of tinymodel gains four special tokens (`<tool_call>`, `</tool_call>`, `<think>`,
`</think>`) and a Qwen-style chat template that renders tools, assistant tool calls and tool
results; mlx-lm then finds the json_tools parser (the template writes `<tool_call>` and
`tool_call.name`) and the think markers, as it does for a real Qwen checkpoint. Its weights are
random, so it never writes a valid call: tests feed the parsing path text directly.
"""

from __future__ import annotations

from pathlib import Path

from harness.synthetic import write_model_folder
from tinymodel import base_vocab_size, llama_config, random_llama, tokenizer_meta

from mlx_kvserve.models.gguf_tokenizer import write_tokenizer_files

EXTRA = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)


# Qwen3-Coder / Qwen3.5's format: XML-style parameters (mlx-lm's qwen3_coder parser), raw strings,
# JSON for other values.
XML_TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Call a tool as <tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}<tool_call>\n"
    "<function={{ tool_call.name }}>\n{%- for key, value in tool_call.arguments.items() %}\n<parameter={{ key }}>\n"
    "{{ value if value is string else value | tojson }}\n</parameter>{%- endfor %}\n</function>\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def build_tool_model(folder: Path, seed: int = 0, template: str = TOOL_TEMPLATE) -> Path:
    """An MLX folder: the tiny llama with the tool-calling, thinking tokenizer above (or `template`)."""
    vocab = base_vocab_size() + len(EXTRA)
    config = llama_config(vocab_size=vocab)
    write_model_folder(folder, config, random_llama(config, seed=seed, scale=4.0))
    meta = tokenizer_meta(vocab)
    first = vocab - len(EXTRA)
    meta["tokenizer.ggml.tokens"][first:] = EXTRA
    meta["tokenizer.ggml.token_type"][first:] = [3] * len(EXTRA)  # control: special tokens
    meta["tokenizer.chat_template"] = template
    write_tokenizer_files(meta, folder)
    return folder
