"""Tiny random-weight llama models built inside the tests: as an MLX folder and as a GGUF file.

The tokenizer is byte-level BPE over the 256 bytes plus ChatML special tokens, rebuilt by the
project's own GGUF tokenizer code, so these models need no download at all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from harness.synthetic import (  # noqa: F401  (re-exported for the tests)
    CHATML,
    SPECIALS,
    base_vocab_size,
    byte_tokens,
    random_llama,
    tokenizer_meta,
    write_model_folder,
)
from harness.synthetic import llama_config as synthetic_config

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "context": 2048}


def vocab_size() -> int:
    return base_vocab_size()


def llama_config(**overrides) -> dict:
    return synthetic_config("tiny", **overrides)


def build_mlx_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight llama in MLX format (float32) with the tiny byte tokenizer."""
    config = llama_config(**overrides)
    # Larger-than-default weights so greedy decoding is not flat.
    return write_model_folder(folder, config, random_llama(config, seed=seed, scale=4.0))


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
