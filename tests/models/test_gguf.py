"""GGUF conversion on a tiny llama written in the test with mixed per-tensor quantization."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
import tinymodel
from click.testing import CliRunner
from mlx_lm.utils import load

from mlx_kvserve.cli import cli
from mlx_kvserve.errors import ModelLoadError
from mlx_kvserve.models.gguf import MARKER_FILE, convert_gguf, is_converted

QUANT = {"attn_q": "Q4_0", "attn_k": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "F16"}
# Dequantized in float32 like llama.cpp (gguf-py), so only float32 rounding separates the two.
ATOL = 1e-5

LAYER_NAMES = {
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
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def expected_name(gguf_name: str) -> str:
    """The mlx-lm weight name a GGUF tensor must end up under (without the `.weight` suffix on input)."""
    if gguf_name in TOP_NAMES:
        return f"{TOP_NAMES[gguf_name]}.weight"
    _, layer, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    truth = tinymodel.write_gguf(path, QUANT)
    return path, truth


@pytest.fixture(scope="module")
def f32_dir(source, tmp_path_factory):
    return convert_gguf(source[0], tmp_path_factory.mktemp("f32") / "model", "float32")


@pytest.fixture(scope="module")
def keep_dir(source, tmp_path_factory):
    return convert_gguf(source[0], tmp_path_factory.mktemp("keep") / "model", "keep")


def test_source_really_mixes_quantization_types(source):
    import gguf

    reader = gguf.GGUFReader(str(source[0]))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0"
    assert types["blk.1.attn_k.weight"] == "Q4_1"
    assert types["blk.0.ffn_down.weight"] == "Q8_0"
    assert types["token_embd.weight"] == "Q8_0"
    assert types["output.weight"] == "F16"
    assert types["blk.0.attn_v.weight"] == "F32"


def test_float32_weights_match_ground_truth(source, f32_dir):
    _, truth = source
    weights = mx.load(str(f32_dir / "model.safetensors"))
    assert set(weights) == {expected_name(name) for name in truth}
    for name, expected in truth.items():
        got = weights[expected_name(name)]
        assert got.dtype == mx.float32, name
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(np.array(got), expected, atol=ATOL, rtol=0, err_msg=name)


def test_float32_config(f32_dir):
    config = json.loads((f32_dir / "config.json").read_text())
    tiny = tinymodel.TINY
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is False  # the file has its own output tensor
    assert config["num_attention_heads"] == tiny["heads"]
    assert config["num_key_value_heads"] == tiny["kv_heads"]
    assert config["head_dim"] == tiny["hidden"] // tiny["heads"]
    assert config["hidden_size"] == tiny["hidden"]
    assert config["num_hidden_layers"] == tiny["layers"]
    assert config["intermediate_size"] == tiny["ffn"]
    assert config["max_position_embeddings"] == tiny["context"]
    assert config["vocab_size"] == tinymodel.vocab_size()
    assert config["eos_token_id"] == [2]
    assert config["bos_token_id"] == 1
    assert "quantization" not in config


def test_keep_records_bits_per_tensor(keep_dir):
    config = json.loads((keep_dir / "config.json").read_text())
    quant = config["quantization"]
    # Four Q4 tensors (attn_q, attn_k in two layers) against three Q8 ones: 4 bits is the common case.
    assert quant["bits"] == 4
    assert quant["group_size"] == 32
    overrides = {k: v["bits"] for k, v in quant.items() if isinstance(v, dict)}
    assert overrides == {
        "model.embed_tokens": 8,
        "model.layers.0.mlp.down_proj": 8,
        "model.layers.1.mlp.down_proj": 8,
    }
    weights = mx.load(str(keep_dir / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert "model.layers.1.self_attn.k_proj.biases" in weights  # Q4_1 carries a per-block minimum
    assert weights["lm_head.weight"].dtype == mx.float16  # F16 stays F16
    assert weights["model.layers.0.self_attn.v_proj.weight"].dtype == mx.float32
    assert "model.layers.0.self_attn.v_proj.scales" not in weights


def test_keep_and_float32_models_give_close_logits(f32_dir, keep_dir):
    f32_model, tokenizer = load(str(f32_dir))
    keep_model, _ = load(str(keep_dir))
    ids = mx.array(tokenizer.encode("the quick brown fox jumps over the lazy dog 123"))[None]
    a = f32_model(ids).astype(mx.float32)
    b = keep_model(ids).astype(mx.float32)
    spread = (a.max() - a.min()).item()
    assert spread > 1.0  # the logits are not flat, so closeness means something
    assert mx.abs(a - b).max().item() < 0.02 * spread
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))


def test_tokenizer_round_trip_and_chat_template(f32_dir):
    _, tokenizer = load(str(f32_dir))
    for text in ["hello the world", "  spaces\tand\nlines 12345", "ünïcödé ✓ 漢字"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode(" the") == [tinymodel.vocab_size() - 1]  # the merged "Ġthe" token
    assert len(tokenizer.encode("123")) == 3  # the smollm pre-tokenizer splits digits
    for i, special in enumerate(tinymodel.SPECIALS):
        assert tokenizer.encode(special) == [i]
    assert tokenizer.encode("<|im_start|>user") == [1, *tokenizer.encode("user")]
    assert 2 in tokenizer.eos_token_ids
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_is_converted_tracks_the_source_file(tmp_path):
    src = tmp_path / "tiny.gguf"
    tinymodel.write_gguf(src, {"attn_q": "Q8_0"})
    dst = tmp_path / "converted"
    assert not is_converted(src, dst, "float32")
    convert_gguf(src, dst, "float32")
    assert is_converted(src, dst, "float32")
    assert not is_converted(src, dst, "float16")
    assert (dst / MARKER_FILE).exists()
    assert not list(tmp_path.glob(".converted.*"))  # the temporary folder was renamed into place
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert not is_converted(src, dst, "float32")


def test_non_llama_architecture_is_rejected(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="mamba"):
        convert_gguf(path, tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()


def test_unreadable_file_and_bad_dtype(tmp_path, source):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        convert_gguf(junk, tmp_path / "out", "float32")
    with pytest.raises(ModelLoadError, match="dtype"):
        convert_gguf(source[0], tmp_path / "out", "int8")


def test_cli_convert_float16(source, tmp_path):
    src, truth = source
    dst = tmp_path / "f16"
    result = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    weights = mx.load(str(dst / "model.safetensors"))
    assert set(weights) == {expected_name(name) for name in truth}
    assert {w.dtype for w in weights.values()} == {mx.float16}
    q = np.array(weights["model.layers.0.self_attn.q_proj.weight"].astype(mx.float32))
    np.testing.assert_allclose(q, truth["blk.0.attn_q"], atol=1e-2, rtol=1e-3)
    assert json.loads((dst / MARKER_FILE).read_text())["dtype"] == "float16"
    assert (dst / "tokenizer.json").exists() and (dst / "config.json").exists()
