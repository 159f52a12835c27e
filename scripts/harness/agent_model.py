"""The random-weight model the agent session (agents.py session) serves, as agents.py clients does
to real agent clients: a tiny llama with SmolLM2's tokenizer and the Qwen-style tool template, biased to end
its replies after a few tokens, built once into a folder and reused while its recipe is unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from harness import default_model_dir

MODEL_VERSION = "try-clients-1"  # bump when the model recipe below changes

# Qwen2.5's layout: the tools go into the system turn, an assistant's calls are <tool_call> JSON, a tool
# result is a user turn in <tool_response>. No thinking block (SmolLM2 has no think tokens). mlx-lm infers
# its json_tools parser from "<tool_call>" and "tool_call.name" in the template. Text is written by
# expressions: transformers renders with trim_blocks, which would eat a newline written after a tag.
TOOL_TEMPLATE = r"""
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
  {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
  {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
  {{- '\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in rest %}
  {%- if message.role == 'assistant' and message.tool_calls %}
    {{- '<|im_start|>assistant\n' + message.content }}
    {%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
      {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) }}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


def bias_eos(model: Any, config: dict, eos_id: int, boost: float) -> None:
    """Make the random model end its replies after a few tokens: the residual stream's dimension 0
    holds the constant `boost` (set by the embedding; no layer reads or writes it) and the lm_head
    maps it to the end-of-turn token only, so that token's logit gets a constant lift."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = dict(tree_flatten(model.parameters()))

    def zero_row(w: mx.array) -> mx.array:
        return mx.concatenate([mx.zeros((1, *w.shape[1:]), w.dtype), w[1:]], axis=0)

    emb = params["model.embed_tokens.weight"]
    update = {
        "model.embed_tokens.weight": mx.concatenate([mx.full((emb.shape[0], 1), boost, emb.dtype), emb[:, 1:]], 1)
    }
    zeroed = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight")
    for i in range(config["num_hidden_layers"]):
        for name in (*zeroed, "post_attention_layernorm.weight"):
            update[f"model.layers.{i}.{name}"] = zero_row(params[f"model.layers.{i}.{name}"])
    head = params["lm_head.weight"]
    column = mx.zeros((head.shape[0], 1), head.dtype)
    column[eos_id, 0] = 1.0
    update["lm_head.weight"] = mx.concatenate([column, head[:, 1:]], 1)
    model.update(tree_unflatten(list(update.items())))
    mx.eval(model.parameters())


def cached_model(context: int = 131072, num_layers: int = 1, num_heads: int = 1) -> Path:
    """build_model's model in the user's cache (~/.cache/mlx-kvserve-try-clients/model*), one folder per recipe."""
    tag = "" if context == 131072 else f"-{context}"
    tag += "" if num_layers == num_heads == 1 else f"-{num_layers}l{num_heads}h"
    folder = Path.home() / ".cache" / "mlx-kvserve-try-clients" / f"model{tag}"
    return build_model(folder, context, 12.0, num_layers, num_heads)


def build_model(folder: Path, context: int, boost: float, num_layers: int = 1, num_heads: int = 1) -> Path:
    """A random llama (float32; 64 dimensions per head) with SmolLM2's tokenizer and a Qwen-style tool
    template (TOOL_TEMPLATE), reused when `folder` already holds this recipe. CPU
    attention cost grows with heads x layers x tokens^2, so one head and one layer keep 30k tokens fast."""
    recipe = {"version": MODEL_VERSION, "context": context, "boost": boost}
    if (num_layers, num_heads) != (1, 1):  # the default recipe keeps its marker: built folders stay valid
        recipe.update(num_layers=num_layers, num_heads=num_heads)
    marker = folder / "try_clients.json"
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return folder
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from harness.synthetic import llama_config, random_llama

    smollm = default_model_dir()
    config = llama_config(
        "tiny",
        vocab_size=49152,
        hidden_size=64 * num_heads,
        intermediate_size=128 * num_heads,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=[2],
    )
    model = random_llama(config, dtype=mx.float32, scale=4.0)  # spread logits: greedy is not always EOS
    bias_eos(model, config, eos_id=2, boost=boost)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(smollm / "tokenizer.json", folder / "tokenizer.json")
    tokenizer_config = json.loads((smollm / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    marker.write_text(json.dumps(recipe))
    return folder
