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
    # Little compute, Llama-3-8B's KV bytes per token in float32 (128 KiB): a CPU exercises the
    # cache's data path (assembly, joins, copies, SSD) at realistic sizes without an 8B model's matmuls.
    "kv-heavy": {
        "hidden_size": 256,
        "num_hidden_layers": 32,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 0,
        "rope_theta": 10000.0,
        "max_position_embeddings": 16384,
    },
    # Deep and narrow (48 layers, 2 KV heads x 16 dims, 12 KiB of float32 KV per token): a hit's cost per
    # layer and per block shows, not its bytes or the model's compute (scripts/bench_engine.py hit-blocks).
    "deep-narrow": {
        "hidden_size": 32,
        "num_hidden_layers": 48,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 1024,
        "rope_theta": 10000.0,
        "max_position_embeddings": 65536,
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


def _with_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` applied; vocab_size 0 becomes the byte tokenizer's own size."""
    config.update(overrides)
    if not config["vocab_size"]:
        config["vocab_size"] = base_vocab_size()
    return config


def llama_config(shape: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """config.json for a llama of a named shape (see SHAPES), with overrides."""
    config = {"model_type": "llama", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": [2]}
    return _with_overrides({**config, **SHAPES[shape]}, overrides)


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


# Tiny configs of mlx-lm model families whose caches are not one plain KVCache per layer: sliding
# windows (RotatingKVCache) and recurrent layers (ArraysCache) mixed with full attention (KVCache).
# Field names follow each family's mlx-lm ModelArgs; shapes are small enough for CPU tests.
_ATTENTION = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_DELTANET = {  # Gated DeltaNet layers (ArraysCache: conv + recurrent state), full attention every 2nd layer
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_5": {
        **_ATTENTION,
        **_DELTANET,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
    # Qwen3.5's predecessor: the same layer mix, with a small mixture of experts.
    "qwen3_next": {
        **_ATTENTION,
        **_DELTANET,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 64,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
    },
    # Sliding-window layers (RotatingKVCache) with every 3rd layer global (KVCache).
    "gemma3_text": {
        **_ATTENTION,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "query_pre_attn_scalar": 16,
        "sliding_window": 24,
        "sliding_window_pattern": 3,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    },
    # Alternating sliding-window and full attention, attention sinks, a mixture of experts.
    "gpt_oss": {
        **_ATTENTION,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-5,
    },
    # Mamba-2 (M), attention (*) and MLP (-) blocks; MLP blocks have no cache entry at all.
    "nemotron_h": {
        **_ATTENTION,
        "hybrid_override_pattern": ["M", "-", "*", "-", "M", "-"],
        "intermediate_size": 128,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "attention_bias": False,
        "mamba_proj_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
    },
    # Short gated convolutions (ArraysCache of one conv state) with full attention layers.
    "lfm2": {
        **_ATTENTION,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        "num_hidden_layers": 6,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "conv_bias": False,
        "conv_L_cache": 3,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
    # Pure Mamba-2: every layer recurrent, no KV at all.
    "mamba2": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_heads": 8,
        "head_dim": 16,
        "intermediate_size": 128,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_rank": "auto",
        # Finite (HF writes [0, Infinity]): config.json stays strict JSON; dt never gets near it.
        "time_step_limit": [0.0, 1.0e4],
        "max_position_embeddings": 4096,
    },
}


def family_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """config.json for a tiny model of an mlx-lm family (a key of FAMILY_CONFIGS), with overrides;
    vocab_size 0 (the default) means the byte tokenizer's own size. Raises KeyError for an
    unknown family."""
    config: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": 0,
        "tie_word_embeddings": False,
        "eos_token_id": [2],
        **json.loads(json.dumps(FAMILY_CONFIGS[model_type])),  # a deep copy: callers may mutate
    }
    return _with_overrides(config, overrides)


def random_model(config: dict[str, Any], seed: int = 0, scale: float = 4.0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Any mlx-lm model class (found from config["model_type"] the way mlx_lm.utils.load finds
    it) with mlx's random init, every matrix and expert stack times `scale`, in `dtype`, evaluated.
    Vectors (norms, biases, A_log, dt_bias, sinks) keep their init: scaling them breaks the
    recurrences. scale=4 (as for the tiny llama) keeps greedy decoding from collapsing to one token."""
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda a: (a * scale if a.ndim >= 2 else a).astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def write_model_folder(folder: Path, config: dict[str, Any], model: nn.Module | None = None) -> Path:
    """config.json and the tokenizer files; the weights too when `model` is given (a folder
    without weights serves benchmarks that keep the model in memory)."""
    from mlx.utils import tree_flatten

    from mlx_kvserve.models.gguf_tokenizer import write_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(tokenizer_meta(config["vocab_size"]), folder)
    if model is not None:
        mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder


def synthetic_model(shape: str, bits: int, folder: Path) -> Path:
    """A random-weight llama of `shape` (SHAPES), `bits`-bit weights
    (0: float16), written to `folder` so that both servers load the same model (the GPU run uses
    the Llama-3-8B shape: no download needed)."""
    overrides = {"quantization": {"group_size": 64, "bits": bits}} if bits else {}
    config = llama_config(shape, **overrides)
    # 8k-32k-token prompts, their chat template and question included (issue 44's 32k over HTTP)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 40960)
    return write_model_folder(folder, config, random_llama(config, dtype=mx.float16))


def float32_model(shape: str, prefix: str) -> Path:
    """A random float32 llama of `shape` (SHAPES) in a new temporary folder: the in-process CPU benches'
    model, float32 being the fast dtype on the CPU."""
    import tempfile

    config = llama_config(shape)
    folder = Path(tempfile.mkdtemp(prefix=prefix)) / "model"
    return write_model_folder(folder, config, random_llama(config, dtype=mx.float32))


def load_bench_model(model: str | None, synthetic: str | None, prefix: str) -> Any:
    """The model an in-process bench runs (mlx_kvserve's LoadedModel, float32): the folder `model`, else a
    random float32 llama of shape `synthetic` (in a temporary folder named `prefix`...), else the default."""
    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.loader import load_model

    from . import default_model_dir

    folder = Path(model) if model else float32_model(synthetic, prefix) if synthetic else default_model_dir()
    return load_model(str(folder), default_home() / "models", "float32")


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """KV cache bytes one token takes in a llama `config` (keys and values, every layer)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes
