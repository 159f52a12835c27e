"""The CPU's attention with its softmax in NumPy (cpu/attention.py): a prompt chunk's queries in blocks,
each against the keys up to its last query. It must give MLX's result for every mask it splits (causal,
with an offset, left padding, a window, attention sinks), split only masks it can prove causal, take the
NumPy softmax only where the rule says it wins (by scores per call, by layers per model), and be what
mlx-lm's models call once installed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from mlx_kvserve.cpu import attention as cpu_attention

SCALE = 0.125


@pytest.fixture
def installed(monkeypatch):
    """The attention with 64-row blocks; counts the calls it makes (query rows, keys), NumPy's or MLX's."""
    calls: list[tuple[int, int]] = []
    real = cpu_attention._one_call

    def counted(q, k, v, *args):
        calls.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, *args)

    monkeypatch.setattr(cpu_attention, "_one_call", counted)
    assert cpu_attention.install(64)
    yield calls
    cpu_attention.uninstall()


def qkv(batch: int, length: int, offset: int, heads: int = 4, kv_heads: int = 2, dims: int = 32):
    mx.random.seed(3)
    q = mx.random.normal((batch, heads, length, dims))
    k = mx.random.normal((batch, kv_heads, offset + length, dims))
    v = mx.random.normal((batch, kv_heads, offset + length, dims))
    return q, k, v


CASES = {
    "causal": (1, 200, 0, lambda L, off: "causal"),
    "causal after a cached prefix": (1, 256, 300, lambda L, off: "causal"),
    "mlx-lm's mask, no padding (the batch cache's)": (1, 192, 40, lambda L, off: create_causal_mask(L, off)),
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
    # each block of 64 queries against the keys up to its last one: fewer scores than one call
    assert installed == [(min(64, length - a), offset + min(a + 64, length)) for a in range(0, length, 64)]


def test_only_the_exact_causal_mask_is_taken_as_causal():
    """mlx-lm's batch cache hands a boolean mask even without padding; exactly causal, it is treated as
    "causal" (the NumPy softmax then masks only the last rows' keys); padding or a window keeps it."""
    plain = create_causal_mask(96, 40)
    assert cpu_attention._as_causal(plain, 96, 136) == "causal"
    assert cpu_attention._as_causal(plain[None, None], 96, 136) == "causal"
    padded = create_causal_mask(96, 40, left_padding=mx.array([0, 5]))
    assert cpu_attention._as_causal(padded, 96, 136) is padded
    window = create_causal_mask(96, 40, window_size=50)
    assert cpu_attention._as_causal(window, 96, 136) is window


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
def test_what_it_cannot_prove_causal_is_one_call(installed, mask):
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
    assert installed == [(length, length + 8)]  # one call
    assert mx.abs(got - expected).max().item() < 1e-5


def test_install_follows_the_settings_and_the_model():
    real = cpu_attention._mlx_attention
    try:
        assert cpu_attention.install(128) and mx.fast.scaled_dot_product_attention is cpu_attention.attention
        assert cpu_attention._rows == 128
        assert cpu_attention.install(0, "numpy") and cpu_attention._rows == 0  # the NumPy softmax, no blocks
        assert cpu_attention.install(8) and cpu_attention._rows == cpu_attention.MIN_ROWS
        assert not cpu_attention.install(128, "mlx") and mx.fast.scaled_dot_product_attention is real
        # a one-layer model: its unread last layer's attention is all the forced work (it lost 5x cold)
        assert not cpu_attention.install(128, "numpy", num_layers=1) and mx.fast.scaled_dot_product_attention is real
        assert cpu_attention.install(128, "numpy", num_layers=2)
    finally:
        cpu_attention.uninstall()


def test_the_cli_installs_it_by_the_model_depth():
    """`mlx-kvserve run` installs it (cli.py), not the engine: for a one-layer model it stays MLX's."""
    from mlx_kvserve import cli
    from mlx_kvserve.config import Config

    real = cpu_attention._mlx_attention
    try:
        cli._install_cpu_attention(Config(), 1)
        assert mx.fast.scaled_dot_product_attention is real
        cli._install_cpu_attention(Config(), 30)
        assert mx.fast.scaled_dot_product_attention is cpu_attention.attention
    finally:
        cpu_attention.uninstall()


def test_blocks_shrink_to_keep_each_within_the_numpy_bound():
    bound = cpu_attention.NUMPY_MAX_SCORES
    assert cpu_attention.block_rows(heads=9, length=512, keys=16384, rows=128) == 128
    # 9 heads over 32k keys: 113 rows per block keep each block's scores within the bound
    rows = cpu_attention.block_rows(heads=9, length=512, keys=32768, rows=128)
    assert rows == bound // (9 * 32768) == 113
    # 32 heads over 32k keys would need blocks under MIN_ROWS: one call (MLX's op, over the bound)
    assert cpu_attention.block_rows(heads=32, length=512, keys=32768, rows=128) == 0
    assert cpu_attention.block_rows(heads=4, length=100, keys=200, rows=64) == 0  # one block only
    assert cpu_attention.block_rows(heads=4, length=512, keys=600, rows=0) == 0  # blocks off


# The softmax through NumPy ([generation] cpu_attention_softmax = "numpy").

NUMPY_CASES = {
    "no mask, one query per row (a decode step)": dict(batch=8, length=1, offset=700, mask=lambda L, off: None),
    "causal after a cached prefix": dict(batch=1, length=96, offset=300, mask=lambda L, off: "causal"),
    "mlx-lm's mask, left padding": dict(
        batch=2, length=120, offset=40, mask=lambda L, off: create_causal_mask(L, off, left_padding=mx.array([0, 17]))
    ),
    "mlx-lm's mask, a window": dict(
        batch=1, length=128, offset=64, mask=lambda L, off: create_causal_mask(L, off, window_size=50)
    ),
    "additive float mask": dict(
        batch=1, length=128, offset=8, mask=lambda L, off: mx.where(create_causal_mask(L, off), 0.0, -1e9)
    ),
    "a mask per query head": dict(
        batch=1,
        length=128,
        offset=16,
        mask=lambda L, off: mx.random.uniform(shape=(1, 4, L, L + off)) > 0.3,
    ),
    "one KV head per query head": dict(batch=1, length=128, offset=16, kv_heads=4, mask=lambda L, off: "causal"),
}


@pytest.mark.parametrize("name", list(NUMPY_CASES))
def test_the_numpy_softmax_gives_mlx_attention(name):
    case = NUMPY_CASES[name]
    q, k, v = qkv(case["batch"], case["length"], case["offset"], kv_heads=case.get("kv_heads", 2))
    mask = case["mask"](case["length"], case["offset"])
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask=mask)
    got = cpu_attention.numpy_softmax_attention(q, k, v, scale=SCALE, mask=mask)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert mx.abs(got - expected).max().item() < 1e-5


def test_the_numpy_softmax_applies_attention_sinks_as_mlx_does():
    q, k, v = qkv(1, 128, 32)
    sinks = mx.random.normal((4,)) * 3
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask="causal", sinks=sinks)
    got = cpu_attention.numpy_softmax_attention(q, k, v, scale=SCALE, mask="causal", sinks=sinks)
    assert mx.abs(got - expected).max().item() < 1e-5
    plain = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask="causal")
    assert mx.abs(got - plain).max().item() > 1e-3  # the sinks did change the result


def test_the_numpy_softmax_keeps_half_precision_inputs():
    q, k, v = (x.astype(mx.float16) for x in qkv(1, 128, 64))
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask="causal")
    got = cpu_attention.numpy_softmax_attention(q, k, v, scale=SCALE, mask="causal")
    assert got.dtype == mx.float16
    assert mx.abs(got.astype(mx.float32) - expected.astype(mx.float32)).max().item() < 2e-3


def test_a_fully_masked_row_averages_the_values_as_mlx_does():
    """A left-padded query row sees no key; MLX's where(mask, scores, min) gives it a uniform softmax
    (not NaN, which would reach the real rows through the padded positions' KV)."""
    q, k, v = qkv(2, 64, 0)
    mask = create_causal_mask(64, 0, left_padding=mx.array([0, 30]))
    got = cpu_attention.numpy_softmax_attention(q, k, v, scale=SCALE, mask=mask)
    assert not mx.any(mx.isnan(got)).item()
    assert mx.abs(got - cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask=mask)).max().item() < 1e-5


@pytest.fixture
def numpy_installed(monkeypatch):
    """The blocks and the NumPy softmax, as the server installs them by default; counts both paths."""
    calls: dict[str, int] = {"mlx": 0, "numpy": 0}
    real_mlx, real_numpy = cpu_attention._mlx_attention, cpu_attention.numpy_softmax_attention

    def counted_mlx(*a, **kw):
        calls["mlx"] += 1
        return real_mlx(*a, **kw)

    def counted_numpy(*a, **kw):
        out = real_numpy(*a, **kw)
        calls["numpy"] += out is not None
        return out

    monkeypatch.setattr(cpu_attention, "_mlx_attention", counted_mlx)
    monkeypatch.setattr(cpu_attention, "numpy_softmax_attention", counted_numpy)
    assert cpu_attention.install(64, "numpy")
    yield calls
    cpu_attention.uninstall()
    mx.fast.scaled_dot_product_attention = real_mlx


def test_installed_prompt_chunks_take_the_numpy_softmax_and_small_calls_mlx(numpy_installed):
    q, k, v = qkv(1, 192, 100)
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask="causal")
    numpy_installed.update(mlx=0, numpy=0)
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal", sinks=None)  # as mlx-lm calls it
    assert mx.abs(got - expected).max().item() < 1e-5
    assert numpy_installed == {"mlx": 0, "numpy": 3}  # three blocks of 64 rows, each through NumPy
    small_q, small_k, small_v = qkv(1, 1, 100)  # 4 x 101 scores: below NUMPY_MIN_SCORES
    mx.fast.scaled_dot_product_attention(small_q, small_k, small_v, scale=SCALE, mask=None)
    assert numpy_installed == {"mlx": 1, "numpy": 3}


def test_inside_mx_compile_it_falls_back_to_mlx(numpy_installed):
    q, k, v = qkv(1, 192, 100)

    @mx.compile
    def attend(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")

    got = attend(q, k, v)
    assert numpy_installed["numpy"] == 0 and numpy_installed["mlx"] > 0
    assert mx.abs(got - cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask="causal")).max().item() < 1e-5


def test_a_call_with_too_many_scores_goes_to_mlx(numpy_installed, monkeypatch):
    monkeypatch.setattr(cpu_attention, "NUMPY_MAX_SCORES", 4 * 100 * 150 - 1)  # one below this call's scores
    q, k, v = qkv(1, 100, 50)
    cpu_attention.attention(q, k, v, scale=SCALE, mask=None)
    assert numpy_installed == {"mlx": 1, "numpy": 0}


@pytest.mark.parametrize("mask", ["causal", None, "array"])
def test_the_numpy_softmax_writes_only_its_own_scores(mask):
    """The softmax overwrites the evaluated scores in place: the inputs, the mask and an earlier result
    stay as they were, and the same call gives the same result again."""
    q, k, v = qkv(1, 96, 40)
    if mask == "array":
        mask = create_causal_mask(96, 40)
    inputs = [mx.array(x) for x in (q, k, v)]
    mask_copy = mx.array(mask) if isinstance(mask, mx.array) else mask
    first = cpu_attention.numpy_softmax_attention(q, k, v, scale=SCALE, mask=mask)
    mx.eval(first)
    kept = mx.array(first)
    second = cpu_attention.numpy_softmax_attention(q, k, v, scale=SCALE, mask=mask)
    assert all(mx.array_equal(a, b).item() for a, b in zip((q, k, v), inputs, strict=True))
    if isinstance(mask, mx.array):
        assert mx.array_equal(mask, mask_copy).item()
    assert mx.array_equal(first, kept).item() and mx.array_equal(first, second).item()
    expected = cpu_attention._mlx_attention(q, k, v, scale=SCALE, mask=mask)
    assert mx.abs(first - expected).max().item() < 1e-5
