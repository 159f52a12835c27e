"""The default model's chat template with tools (models/default_template.py): the same prompt as
SmolLM2's own template without tools, Qwen2.5's layout with them, and markers mlx-lm reads as json_tools."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jinja2
import pytest
from mlx_lm.tokenizer_utils import _infer_tool_parser

from mlx_kvserve.models.default_template import TOOL_TEMPLATE, install_tool_template

# SmolLM2-135M-Instruct's template as its GGUF ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def render(template: str, messages: list[dict], **kwargs) -> str:
    env = jinja2.Environment()
    env.filters["tojson"] = lambda x: json.dumps(x)  # as transformers renders it
    return env.from_string(template).render(messages=messages, **kwargs)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "plan mode"},
            {"role": "user", "content": "again"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_the_prompt_is_smollm2s_own(messages, add_generation_prompt):
    expected = render(SMOLLM2_TEMPLATE, messages, add_generation_prompt=add_generation_prompt)
    assert render(TOOL_TEMPLATE, messages, add_generation_prompt=add_generation_prompt) == expected


def test_tools_calls_and_results_render_as_qwen_does():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
    ]
    text = render(TOOL_TEMPLATE, messages, tools=[WEATHER], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_mlx_lm_reads_its_calls_as_json_tools():
    tokenizer = SimpleNamespace(chat_template=TOOL_TEMPLATE, get_vocab=lambda: {})
    assert _infer_tool_parser(tokenizer) == "json_tools"


def test_the_template_goes_into_the_converted_folder_once(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": "x"}))
    install_tool_template(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config == {"eos_token": "<|im_end|>", "chat_template": TOOL_TEMPLATE}
    stamp = (tmp_path / "tokenizer_config.json").stat().st_mtime_ns
    install_tool_template(tmp_path)  # already there: not written again
    assert (tmp_path / "tokenizer_config.json").stat().st_mtime_ns == stamp
