"""The CPU's block-causal attention (engine/cpu_attention.py): a prompt chunk's queries in blocks, each
against the keys up to its last query. It must give MLX's result for every mask it splits (causal, with
an offset, left padding, a window, attention sinks), split only masks it can prove causal, and be what
mlx-lm's models call once installed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from mlx_kvserve.engine import cpu_attention

SCALE = 0.125


@pytest.fixture
def installed(monkeypatch):
    """The block attention with 64-row blocks; counts the MLX attention calls it makes."""
    calls: list[tuple[int, int]] = []
    real = cpu_attention._mlx_attention

    def counted(q, k, v, **kwargs):
        calls.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(cpu_attention, "_mlx_attention", counted)
    assert cpu_attention.install(64)
    yield calls
    cpu_attention.uninstall()
    mx.fast.scaled_dot_product_attention = real  # uninstall put back the counting stand-in


def qkv(batch: int, length: int, offset: int, heads: int = 4, kv_heads: int = 2, dims: int = 32):
    mx.random.seed(3)
    q = mx.random.normal((batch, heads, length, dims))
    k = mx.random.normal((batch, kv_heads, offset + length, dims))
    v = mx.random.normal((batch, kv_heads, offset + length, dims))
    return q, k, v


CASES = {
    "causal": (1, 200, 0, lambda L, off: "causal"),
    "causal after a cached prefix": (1, 256, 300, lambda L, off: "causal"),
    "mlx-lm's mask, left padding": (
        2,
        192,
        40,
        lambda L, off: create_causal_mask(L, off, left_padding=mx.array([0, 17])),
    ),
    "mlx-lm's mask, a window": (1, 256, 64, lambda L, off: create_causal_mask(L, off, window_size=100)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_it_gives_mlx_attention_for_every_causal_mask(installed, name):
    batch, length, offset, make_mask = CASES[name]
    q, k, v = qkv(batch, length, offset)
    mask = make_mask(length, offset)
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask=mask)
    installed.clear()
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)  # what mlx-lm's models call
    assert mx.abs(got - expected).max().item() < 1e-5
    blocks = -(-length // 64)
    # each block of 64 queries against the keys up to its last one: fewer scores than one call
    assert installed == [(min(64, length - a), offset + min(a + 64, length)) for a in range(0, length, 64)]
    assert len(installed) == blocks


def test_sinks_pass_through(installed):
    q, k, v = qkv(1, 160, 32)
    sinks = mx.random.normal((4,))
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask="causal", sinks=sinks)
    got = cpu_attention.attention(q, k, v, scale=SCALE, mask="causal", sinks=sinks)
    assert mx.abs(got - expected).max().item() < 1e-5


@pytest.mark.parametrize(
    "mask",
    [None, "lets a query see a later key", "additive float mask", "too short to split"],
)
def test_what_it_cannot_prove_causal_goes_to_mlx_unchanged(installed, mask):
    length = 40 if mask == "too short to split" else 192
    q, k, v = qkv(1, length, 8)
    if mask == "lets a query see a later key":
        m = create_causal_mask(length, 8)
        mask = m | (mx.arange(length + 8)[None] == length + 7)  # every query also sees the last key
    elif mask == "additive float mask":
        mask = mx.where(create_causal_mask(length, 8), 0.0, -1e9)
    elif mask == "too short to split":
        mask = "causal"
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask=mask)
    installed.clear()
    got = cpu_attention.attention(q, k, v, scale=SCALE, mask=mask)
    assert installed == [(length, length + 8)]  # one call, MLX's own
    assert mx.array_equal(got, expected)


def test_install_follows_the_setting():
    real = cpu_attention._mlx_attention
    try:
        assert cpu_attention.install(128) and mx.fast.scaled_dot_product_attention is cpu_attention.attention
        assert not cpu_attention.install(0) and mx.fast.scaled_dot_product_attention is real
        assert cpu_attention.install(8) and cpu_attention._rows == cpu_attention.MIN_ROWS
    finally:
        cpu_attention.uninstall()
