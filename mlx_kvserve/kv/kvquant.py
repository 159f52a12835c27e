"""Quantized KV (`[cache] kv_bits`): 8 or 4 bits per value, a power-of-two scale per group.

A power-of-two scale makes rounding idempotent, bit for bit: a value already rounded quantizes
back to exactly itself. That is what lets a cache hit equal a cold run: the engine rounds every
key and value as it enters the cache (so attention always sees rounded KV, cold or not), blocks
store the integers and exponents (2x smaller than fp16 at 8 bits, 4x at 4 bits), and a hit
dequantizes them back to exactly the values the cold run had. (mlx's affine quantization is not
idempotent: rounding twice moves values, so blocks re-quantized from a cache would not match.)
"""

from __future__ import annotations

import mlx.core as mx

GROUP = 32  # values per scale, along the head dimension
BITS = (4, 8)


def supported(head_dim: int) -> bool:
    return head_dim % GROUP == 0


def _grouped(x: mx.array) -> mx.array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)


def quantize(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """(integers, exponents): int8 values in [-(2^(bits-1) - 1), 2^(bits-1) - 1] (4 bits: two per
    uint8, low nibble first) and one int8 power-of-two exponent per group of GROUP values."""
    qmax = 2 ** (bits - 1) - 1
    g = _grouped(x.astype(mx.float32))
    amax = mx.max(mx.abs(g), axis=-1, keepdims=True)
    exp = mx.ceil(mx.log2(mx.maximum(amax, 1e-30) / qmax))
    exp = mx.clip(exp, -126, 127)
    q = mx.clip(mx.round(g * mx.power(2.0, -exp)), -qmax, qmax).astype(mx.int8)
    q = q.reshape(x.shape)
    if bits == 4:
        nib = q.astype(mx.uint8) & 15
        q = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(mx.uint8)
    return q, exp.squeeze(-1).astype(mx.int8)


def dequantize(q: mx.array, exp: mx.array, bits: int, dtype: mx.Dtype) -> mx.array:
    """The values `quantize` rounded to, in `dtype` (exact: small integers times powers of two)."""
    if bits == 4:
        lo = (q & 15).astype(mx.int8)
        hi = (q >> 4).astype(mx.int8)
        lo = mx.where(lo > 7, lo - 16, lo)
        hi = mx.where(hi > 7, hi - 16, hi)
        q = mx.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    g = _grouped(q.astype(mx.float32)) * mx.power(2.0, exp.astype(mx.float32))[..., None]
    return g.reshape(q.shape).astype(dtype)


def round_trip(x: mx.array, bits: int) -> mx.array:
    """`x` rounded to what `bits`-bit blocks store (idempotent)."""
    q, exp = quantize(x, bits)
    return dequantize(q, exp, bits, x.dtype)
