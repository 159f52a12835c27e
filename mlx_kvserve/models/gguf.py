"""Convert a llama-family `.gguf` file into an MLX model folder mlx-lm can load.

Weights come through `mx.load`, which reads GGUF and returns quantized tensors (Q4_0, Q4_1,
Q8_0) as MLX affine-quantized triples (weight, scales, biases) with group size 32. The number of
bits can differ from tensor to tensor (e.g. a Q8 embedding in a Q4 file), so it is derived per
tensor from the packed width. llama.cpp stores q/k rows permuted for interleaved RoPE, so the
config sets `rope_traditional`, which makes mlx-lm's llama apply RoPE the same way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from ..checked_json import Int, Obj, Str, read_json
from ..errors import ModelLoadError
from ..progress import progress_bar
from .gguf_tokenizer import eos_token_ids, write_tokenizer_files

log = logging.getLogger(__name__)

GGUF_GROUP_SIZE = 32
CONVERSION_VERSION = 2  # 2: quantized tensors dequantized in float32
MARKER_FILE = "mlx_kvserve_conversion.json"
MAX_MARKER_BYTES = 64 * 1024
MARKER_SCHEMA = Obj(
    {
        "version": Int(0, 2**31),
        "source": Str(16384),
        "size": Int(0, 2**63),
        "mtime_ns": Int(-(2**63), 2**63),
        "dtype": Str(16),
    }
)
Dtype = Literal["float32", "float16", "bfloat16", "keep"]
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "keep")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def mlx_name(gguf_name: str) -> str | None:
    """The mlx-lm parameter name for a GGUF tensor name, or None for tensors mlx-lm has no use for."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif m := _TOP_RE.match(gguf_name):
        part, kind = m.groups()
        if part in _TOP_NAMES:
            return f"{_TOP_NAMES[part]}.{kind}"
    return None


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def model_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm llama config from GGUF metadata. Raises ModelLoadError for other architectures."""
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (llama family only)")

    def get(key: str, default: Any = None) -> Any:
        return _scalar(meta, f"llama.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in weights,
        "eos_token_id": eos_token_ids(meta),
    }
    if _scalar(meta, "tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
    if str(get("rope.scaling.type", "none")) == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    return config


def tensor_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per weight of a GGUF-quantized tensor: packed uint32 width over input width."""
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits, rem = divmod(weight.shape[-1] * 32, in_features)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise ModelLoadError(f"cannot infer quantization bits from shapes {weight.shape}/{scales.shape}")
    return bits


def convert_weights(
    weights: dict[str, mx.array], dtype: Dtype, on_tensor: Callable[[], None] | None = None
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename GGUF tensors to mlx-lm names and either dequantize them to `dtype` or keep them
    quantized. Returns (weights, quantization config or None). `on_tensor`: called after each GGUF
    tensor, its results computed then (MLX is lazy: else all the work lands in the final save)."""
    out: dict[str, mx.array] = {}
    layer_bits: dict[str, int] = {}
    for name, array in weights.items():
        if on_tensor is not None:
            mx.eval(list(islice(reversed(out.values()), 3)))  # the previous tensor's weight, scales, biases
            on_tensor()
        target = mlx_name(name)
        if target is None or name.endswith((".scales", ".biases")):
            continue
        base = name.rsplit(".", 1)[0]
        scales = weights.get(f"{base}.scales")
        if scales is None:
            out[target] = array if dtype == "keep" else array.astype(getattr(mx, dtype))
            continue
        biases = weights.get(f"{base}.biases")
        bits = tensor_bits(array, scales)
        prefix = target.rsplit(".", 1)[0]
        if dtype == "keep":
            out[target], out[f"{prefix}.scales"] = array, scales
            if biases is not None:
                out[f"{prefix}.biases"] = biases
            layer_bits[prefix] = bits
        else:
            # In float32: with the float16 scales as stored, MLX would round every weight to float16.
            f32_biases = None if biases is None else biases.astype(mx.float32)
            full = mx.dequantize(array, scales.astype(mx.float32), f32_biases, group_size=GGUF_GROUP_SIZE, bits=bits)
            out[target] = full.astype(getattr(mx, dtype))
        mx.eval(out[target])
    if not layer_bits:
        return out, None
    common = Counter(layer_bits.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
    for prefix, bits in layer_bits.items():
        if bits != common:
            quant[prefix] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}
    return out, quant


def _source_stamp(src: Path, dtype: str) -> dict[str, Any]:
    st = src.stat()
    return {
        "version": CONVERSION_VERSION,
        "source": str(src.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
    }


def is_converted(src: Path, dst: Path, dtype: str) -> bool:
    """True when `dst` holds a finished conversion of this exact `src` file and dtype. A damaged
    marker is logged and means "not converted": the conversion then replaces the whole folder."""
    marker = dst / MARKER_FILE
    try:
        return read_json(marker, MARKER_SCHEMA, MAX_MARKER_BYTES) == _source_stamp(src, dtype)
    except FileNotFoundError:
        return False
    except ValueError as exc:  # checked_json.DamagedFileError
        log.warning("conversion marker %s is damaged (%s): converting again", marker, exc)
        return False


def convert_gguf(src: Path, dst: Path, dtype: Dtype = "float32", progress: Callable[[str], None] = log.info) -> Path:
    """Write an MLX model folder for the GGUF file `src` at `dst` (atomically: a temp folder
    renamed into place). Raises ModelLoadError for unreadable or unsupported files."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        weights, meta = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {src}: {exc}") from exc
    progress(f"converting {src.name}: {len(weights)} tensors -> {dtype}")
    config = model_config(meta, weights)
    with progress_bar(len(weights), f"converting {src.name}", "tensor") as bar:
        converted, quantization = convert_weights(weights, dtype, on_tensor=lambda: bar.update(1))
    if quantization:
        config["quantization"] = quantization
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), converted, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer_files(meta, tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(_source_stamp(src, dtype)))
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted model written to {dst}")
    return dst
