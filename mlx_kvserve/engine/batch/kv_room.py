"""Admission by memory ([server] kv_batch_bytes): the KV the requests in the batch may hold together.

A request is counted at its most, prompt + max_tokens, from the moment it starts until it ends, in the
shape mlx-lm's batch holds it: a row as long as the batch's longest, grown in steps of 256 tokens. A pending request whose KV would not fit beside the running ones' waits
(the scheduler starts nothing past it until one ends, so it is never passed for ever); one that would
not fit even alone never reaches the batch, because the same budget caps the context the server serves
and tells (Engine.context_length), so it is refused up front with the context error naming that window.
Estimated from the model's config, never measured: attention layers of `num_key_value_heads` x
`head_dim`, keys and values, at the activations' width; sliding-window and recurrent layers are counted
as full attention (the estimate errs on the side of room).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

STEP = 256  # mlx-lm's KV caches grow their arrays in steps of this many tokens


class Sized(Protocol):
    prompt_tokens: list[int]
    params: Any  # SamplingParams: its max_tokens


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int, kv_bits: int = 0) -> int:
    """KV bytes one token takes in every layer of a model with this config.json (0 when the config
    names no attention shape). `kv_bits` 4 or 8: quantized KV, with a float16 scale and bias per 64."""
    text = config.get("text_config") or config
    layers = int(text.get("num_hidden_layers") or 0)
    heads = int(text.get("num_attention_heads") or 0)
    if not layers or not heads:
        return 0
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size") or 0) // heads)
    per_vector = head_dim * dtype_bytes if not kv_bits else head_dim * kv_bits // 8 + 2 * 2 * -(-head_dim // 64)
    return 2 * layers * kv_heads * per_vector


class KvRoom:
    """The batch's KV budget: `budget_bytes` for the requests running together. mlx-lm's batch holds
    one row per request, each as long as the longest (left-padded), grown in steps of STEP tokens; a
    request is counted at its most, prompt + max_tokens. Pure: the scheduler asks, and it answers."""

    def __init__(self, budget_bytes: int, bytes_per_token: int):
        self.budget_bytes, self.bytes_per_token = budget_bytes, max(bytes_per_token, 1)

    @property
    def max_tokens(self) -> int:
        """The longest sequence (prompt + completion) whose KV fits the budget alone, in whole steps."""
        return self.budget_bytes // self.bytes_per_token // STEP * STEP

    def batch_bytes(self, reqs: list[Sized]) -> int:
        """The KV of `reqs` in one batch at their most: rows x the longest, in whole steps."""
        longest = max((len(r.prompt_tokens) + int(r.params.max_tokens) for r in reqs), default=0)
        return len(reqs) * -(-longest // STEP) * STEP * self.bytes_per_token

    def fits(self, req: Sized, running: Iterable[Sized]) -> bool:
        """Whether `req` may start beside `running`. A request alone always may: the context cap
        keeps any that could not out of the batch, and refusing it here would only stall it."""
        held = list(running)
        return not held or self.batch_bytes([*held, req]) <= self.budget_bytes


def model_kv_bytes_per_token(model: Any, config: dict[str, Any], kv_bits: int = 0) -> int:
    """kv_bytes_per_token of `model` (an MLX module with this config.json), at its activations' width:
    the narrowest floating weights (a quantized model's scales, else its weights)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    widths = [a.dtype.size for _, a in tree_flatten(model.parameters()) if mx.issubdtype(a.dtype, mx.floating)]
    return kv_bytes_per_token(config, min(widths, default=2), kv_bits)


def for_model(model: Any, config: dict[str, Any], budget_bytes: int, kv_bits: int = 0) -> KvRoom | None:
    """The KvRoom of `model` (an MLX module with this config.json) for [server] kv_batch_bytes =
    `budget_bytes`; None when that is 0 (off) or the config names no attention shape. ConfigError
    when the budget holds less than one step (STEP tokens)."""
    if not budget_bytes:
        return None
    from ...errors import ConfigError

    per_token = model_kv_bytes_per_token(model, config, kv_bits)
    if not per_token:
        return None
    room = KvRoom(budget_bytes, per_token)
    if room.max_tokens < STEP:
        raise ConfigError(
            f"server.kv_batch_bytes: {budget_bytes} bytes hold {room.max_tokens} tokens of this model's KV "
            f"({per_token} bytes each); give at least {STEP * per_token}",
            param="server.kv_batch_bytes",
        )
    return room
