"""Bytes a cache checkpoint and a token cost for hybrid and sliding-window model families.

From config fields, by the shapes mlx-lm 0.32.2 stores (checked against a tiny model's real
cache at the end). Recurrent layers: a conv state of (kernel - 1) x conv channels in the model's
dtype and, for Mamba-2 and Gated DeltaNet, a recurrent state that mlx-lm keeps in float32 even for
bf16 weights. Sliding-window layers: at least max_size (= sliding_window) positions of K and V.

    .venv/bin/python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/family_state_sizes.py
"""

from __future__ import annotations

from typing import Any, NamedTuple

MiB = 2**20
F32 = 4


class Sizes(NamedTuple):
    recurrent_layers: int
    state_bytes: int  # per checkpoint: every recurrent layer's conv + recurrent state
    window_layers: int
    window_bytes: int  # per checkpoint: sliding layers x max_size positions of K and V
    kv_layers: int
    kv_bytes_per_token: int  # full-attention layers only


def _kv(kv_heads: int, head_dim: int, act: int) -> int:
    return 2 * kv_heads * head_dim * act


def sizes(c: dict[str, Any], act: int = 2) -> Sizes:
    """`act`: bytes of the model's activation dtype (2 for bf16/fp16)."""
    t = c["model_type"]
    heads_dim = c.get("head_dim") or (c["hidden_size"] // c["num_attention_heads"] if "num_attention_heads" in c else 0)
    if t in ("qwen3_5", "qwen3_next"):
        n = c["num_hidden_layers"]
        full = sum((i + 1) % c["full_attention_interval"] == 0 for i in range(n))
        nk, dk, nv, dv = (
            c[f"linear_{k}"] for k in ("num_key_heads", "key_head_dim", "num_value_heads", "value_head_dim")
        )
        conv = (c["linear_conv_kernel_dim"] - 1) * (2 * nk * dk + nv * dv) * act
        state = nv * dv * dk * F32
        return Sizes(
            n - full, (n - full) * (conv + state), 0, 0, full, full * _kv(c["num_key_value_heads"], heads_dim, act)
        )
    if t in ("nemotron_h", "mamba2"):
        if t == "nemotron_h":
            pattern = c["hybrid_override_pattern"]
            mamba, attn, h, hd = pattern.count("M"), pattern.count("*"), c["mamba_num_heads"], c["mamba_head_dim"]
            kv = attn * _kv(c["num_key_value_heads"], heads_dim, act)
        else:
            mamba, attn, h, hd, kv = c["num_hidden_layers"], 0, c["num_heads"], c["head_dim"], 0
        n_state = c.get("ssm_state_size") or c["state_size"]
        conv = (c["conv_kernel"] - 1) * (h * hd + 2 * c["n_groups"] * n_state) * act
        state = h * hd * n_state * F32
        return Sizes(mamba, mamba * (conv + state), 0, 0, attn, kv)
    if t == "lfm2":
        convs = sum(lt != "full_attention" for lt in c["layer_types"])
        attn = len(c["layer_types"]) - convs
        conv = (c["conv_L_cache"] - 1) * c["hidden_size"] * act
        return Sizes(convs, convs * conv, 0, 0, attn, attn * _kv(c["num_key_value_heads"], heads_dim, act))
    if t in ("gemma3_text", "gpt_oss"):
        if t == "gemma3_text":
            p = c["sliding_window_pattern"]
            full = sum(i % p == p - 1 for i in range(c["num_hidden_layers"]))
        else:
            full = c["layer_types"].count("full_attention")
        sliding = c["num_hidden_layers"] - full
        per_token = _kv(c["num_key_value_heads"], heads_dim, act)
        return Sizes(0, 0, sliding, sliding * c["sliding_window"] * per_token, full, full * per_token)
    raise ValueError(f"no size formula for {t}")


def _layers(pattern: str, attention_at: tuple[int, ...], n: int) -> list[str]:
    return ["full_attention" if i in attention_at else pattern for i in range(n)]


# Published shapes (fields as in each model's config.json). Sources: the models' config.json as
# quoted in public code; "(recalled)" marks shapes I could not cross-check there.
REAL: dict[str, dict[str, Any]] = {
    "Qwen3-Next-80B-A3B": dict(
        model_type="qwen3_next",
        hidden_size=2048,
        num_hidden_layers=48,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_num_value_heads=32,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
    ),
    "Qwen3.5-9B": dict(
        model_type="qwen3_5",
        hidden_size=4096,
        num_hidden_layers=32,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_num_value_heads=32,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
    ),
    "Qwen3.5-27B": dict(
        model_type="qwen3_5",
        hidden_size=5120,
        num_hidden_layers=64,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_num_value_heads=48,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
    ),
    "Nemotron-H-8B": dict(
        model_type="nemotron_h",
        hidden_size=4096,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "Nemotron-3-Super-120B-A12B": dict(
        model_type="nemotron_h",
        hidden_size=4096,
        hybrid_override_pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
    ),
    "LFM2-1.2B": dict(
        model_type="lfm2",
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        conv_L_cache=3,
        layer_types=_layers("conv", (2, 5, 8, 10, 12, 14), 16),
    ),
    "mamba2-780m": dict(
        model_type="mamba2",
        hidden_size=1536,
        num_hidden_layers=48,
        num_heads=48,
        head_dim=64,
        state_size=128,
        n_groups=1,
        conv_kernel=4,
    ),
    "mamba2-2.7b (recalled)": dict(
        model_type="mamba2",
        hidden_size=2560,
        num_hidden_layers=64,
        num_heads=80,
        head_dim=64,
        state_size=128,
        n_groups=1,
        conv_kernel=4,
    ),
    "gemma-3-27b (recalled)": dict(
        model_type="gemma3_text",
        hidden_size=5376,
        num_hidden_layers=62,
        sliding_window_pattern=6,
        sliding_window=1024,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
    ),
    "gpt-oss-120b (recalled)": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=36,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
    ),
}


def _fmt(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def table(shapes: dict[str, dict[str, Any]]) -> None:
    print(
        "| model | recurrent layers | state per checkpoint | window layers | window per checkpoint | KV layers | KV per token |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, config in shapes.items():
        s = sizes(config)
        print(
            f"| {name} | {s.recurrent_layers} | {_fmt(s.state_bytes)} | {s.window_layers} | {_fmt(s.window_bytes)} "
            f"| {s.kv_layers} | {_fmt(s.kv_bytes_per_token)} |"
        )


def check_against_tiny() -> None:
    """The formula against the real cache of each tiny family model with bf16 weights."""
    import mlx.core as mx
    from harness.synthetic import random_model
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    for family, config in tiny_configs().items():
        model = random_model(config, dtype=mx.bfloat16)
        cache = make_prompt_cache(model)
        model(mx.array([list(range(3, 43))]), cache=cache)
        measured = sum(c.nbytes for c in cache if isinstance(c, ArraysCache))
        predicted = sizes(config).state_bytes
        print(
            f"  {family}: recurrent state measured {measured} B, formula {predicted} B",
            "OK" if measured == predicted else "MISMATCH",
        )


def tiny_configs() -> dict[str, dict[str, Any]]:
    from harness.synthetic import FAMILY_CONFIGS, family_config

    configs = {family: family_config(family) for family in FAMILY_CONFIGS}
    pattern = configs["nemotron_h"]["hybrid_override_pattern"]
    configs["nemotron_h"]["hybrid_override_pattern"] = "".join(pattern)  # mlx-lm takes a list or a string
    return configs


if __name__ == "__main__":
    print("Realistic shapes, bf16 weights (recurrent state float32):")
    table(REAL)
    print("\nTiny test models (tests/familymodels.py), bf16:")
    table(tiny_configs())
    print("\nFormula vs. a real prefilled cache:")
    check_against_tiny()
