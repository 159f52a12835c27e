"""Random-weight llama models with a byte-level tokenizer, built locally with no download.

For benchmarks at real model shapes (a Llama-3-8B-shaped model, 4-bit, on a GPU) and for tests
(a tiny model on the CPU). The tokenizer is byte-level BPE over the 256 bytes plus ChatML special
tokens, padded with plain filler tokens up to the model's vocabulary, so any id the model samples
decodes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he"]

# mlx-lm llama ModelArgs fields. llama3-8b: Meta-Llama-3-8B's shape (KV 128 KiB per token in fp16).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 32768,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 0,  # 0: the byte tokenizer's own size
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    },
}


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def base_vocab_size() -> int:
    """Specials, bytes and merged tokens: the smallest vocabulary the tokenizer has."""
    return len(SPECIALS) + 256 + len(MERGES)


def tokenizer_meta(vocab_size: int = 0) -> dict[str, Any]:
    """GGUF-style tokenizer metadata (what `gguf_tokenizer.write_tokenizer_files` takes), padded
    with filler tokens `<|fill_N|>` up to `vocab_size` (0: no padding)."""
    tokens = SPECIALS + byte_tokens() + ["Ġt", "he", "Ġthe"]
    tokens += [f"<|fill_{i}|>" for i in range(max(0, vocab_size - len(tokens)))]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def llama_config(shape: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """config.json for a llama of a named shape (see SHAPES), with overrides."""
    config: dict[str, Any] = {
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": [2],
        **SHAPES[shape],
    }
    config.update(overrides)
    if not config["vocab_size"]:
        config["vocab_size"] = base_vocab_size()
    return config


def random_llama(config: dict[str, Any], seed: int = 0, dtype: mx.Dtype = mx.float32, scale: float = 1.0) -> nn.Module:
    """A llama with random weights (mlx's init, matrices times `scale`), in `dtype`, quantized
    when config has "quantization". Evaluated layer by layer: the peak memory stays near one
    layer at full precision plus the result (an 8B shape fits a GPU at 4 bits)."""
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda a: (a * scale if a.ndim == 2 else a).astype(dtype), model.parameters()))
    quant = config.get("quantization")
    if quant:
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"])
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def write_model_folder(folder: Path, config: dict[str, Any], model: nn.Module | None = None) -> Path:
    """config.json and the tokenizer files; the weights too when `model` is given (a folder
    without weights serves benchmarks that keep the model in memory)."""
    from mlx.utils import tree_flatten

    from .gguf_tokenizer import write_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(tokenizer_meta(config["vocab_size"]), folder)
    if model is not None:
        mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder
