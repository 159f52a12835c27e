"""Tiny random-weight llama models built inside the tests: as an MLX folder and as a GGUF file.

The tokenizer is byte-level BPE over the 256 bytes plus ChatML special tokens, rebuilt by the
project's own GGUF tokenizer code, so these models need no download at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


def tokenizer_meta() -> dict:
    tokens = SPECIALS + byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "context": 2048}


def vocab_size() -> int:
    return len(tokenizer_meta()["tokenizer.ggml.tokens"])


def llama_config(**overrides) -> dict:
    config = {
        "model_type": "llama",
        "hidden_size": TINY["hidden"],
        "num_hidden_layers": TINY["layers"],
        "intermediate_size": TINY["ffn"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"],
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size(),
        "rope_theta": 10000.0,
        "max_position_embeddings": TINY["context"],
        "tie_word_embeddings": False,
        "eos_token_id": [2],
    }
    config.update(overrides)
    return config


def build_mlx_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight llama in MLX format (float32) with the tiny byte tokenizer."""
    from mlx_lm.models import llama

    from mlx_kvserve.models.gguf_tokenizer import write_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(**overrides)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger-than-default weights so greedy decoding is not flat.
    params = {k: v * 4 if v.ndim == 2 else v for k, v in _flatten(model.parameters()).items()}
    mx.save_safetensors(str(folder / "model.safetensors"), params)
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer_files(tokenizer_meta(), folder)
    return folder


def _flatten(tree, prefix: str = "") -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(tree))


def write_gguf(path: Path, quant: dict[str, str], seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF; `quant` maps a tensor kind ("attn_q", "token_embd", ...) to a GGML
    type name ("Q4_0", "Q8_0", "Q4_1", "F16"); others are F32. Returns the float weights each
    tensor decodes to (GGUF names), the ground truth for conversion tests."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    h, f, heads, kv = TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"]
    hd = h // heads
    shapes = {"token_embd": (vocab_size(), h), "output_norm": (h,), "output": (vocab_size(), h)}
    per_layer = {
        "attn_q": (h, h),
        "attn_k": (kv * hd, h),
        "attn_v": (kv * hd, h),
        "attn_output": (h, h),
        "ffn_gate": (f, h),
        "ffn_up": (f, h),
        "ffn_down": (h, f),
        "attn_norm": (h,),
        "ffn_norm": (h,),
    }
    for layer in range(TINY["layers"]):
        shapes.update({f"blk.{layer}.{k}": s for k, s in per_layer.items()})
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(h)
    writer.add_block_count(TINY["layers"])
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab_size())
    meta = tokenizer_meta()
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    truth = {}
    for name, shape in shapes.items():
        data = (rng.standard_normal(shape) * (1.0 if len(shape) == 2 else 0.1) + (len(shape) == 1)).astype(np.float32)
        kind = name.split(".")[-1]
        qtype = getattr(gguf.GGMLQuantizationType, quant.get(kind, "F32"))
        if qtype == gguf.GGMLQuantizationType.F32:
            stored, truth[name] = data, data
        elif qtype == gguf.GGMLQuantizationType.F16:
            stored = data.astype(np.float16)
            truth[name] = stored.astype(np.float32)
        else:
            stored = quantize(data, qtype)
            truth[name] = dequantize(stored, qtype)
        writer.add_tensor(f"{name}.weight", stored, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return truth
