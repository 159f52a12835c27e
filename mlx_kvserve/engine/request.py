"""What the HTTP side hands the worker, and what the worker sends back.

Events travel from the worker thread to the request's owner through `GenerationRequest.emit`
(the server wraps an asyncio queue in it). Errors are sent as values, never raised across threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    logprobs: bool = False  # attach each sampled token's logprob to its TextDelta
    top_logprobs: int = 0  # and this many most likely alternatives (implies logprobs)
    json_schema: dict | None = None  # structured output: every completion token keeps the text valid for it
    grammar: str | None = None  # a Lark grammar the reply follows (tool calls); replaces json_schema
    # OpenAI's penalties, over the tokens this completion generated: logit -= presence * (count > 0)
    # + frequency * count; and logit_bias, added to the logits: ((token id, bias), ...).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    speculative: str = ""  # the kvserve extension's speculative mode; "" = the server's [speculative] mode

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.grammar is not None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token, its log-probability and the most likely alternatives [(token, logprob)]."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text (possibly empty while a stop string may be forming) and the tokens behind it.
    `logprobs`: one entry per token behind it, when the request asked for them."""

    text: str
    num_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    first_token_s: float  # seconds from start of work to the first generated token
    token_ids: tuple[int, ...] = ()  # the completion's tokens (eos not included)


@dataclass(frozen=True)
class Failed:
    error: Exception


Event = TextDelta | Finished | Failed


@dataclass
class GenerationRequest:
    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[], None] | None = None  # called by the worker after everything, KV registration included
    # Prompt positions worth a checkpoint for hybrid / sliding-window models (where the last message
    # starts: the prefix the next request in the conversation or with the same system prompt shares).
    checkpoint_at: tuple[int, ...] = ()
    # The prompt's full-block hash chain, computed once (Engine.block_hashes, at submit at the
    # latest) and read by every stage after: leases, shared-prefix waits, lookup, registration.
    block_hashes: list[bytes] | None = None
    # A prompt with images (vision/runtime.py): each image's placeholder span (vision.families.ImageSpan),
    # and the ids the block cache keys the prompt by, where each image's placeholder ids are replaced by
    # keys derived from its pixel digest (None: the prompt's own ids).
    images: tuple[Any, ...] = ()
    cache_tokens: list[int] | None = None
    # [cache] isolation = "per_key": the principal's identity (api_keys.Principal; "" = the plain
    # namespace), and the root of its chain (kv/salts.py), which Engine.submit sets from it.
    principal: str = ""
    cache_root: bytes | None = None

    def cancel(self) -> None:
        """Ask the worker to stop this request at the next token (safe from any thread)."""
        self.cancelled.set()

    def cache_keys(self, tokens: list[int]) -> list[int]:
        """`tokens` (this prompt's, then generated ones) as the block cache keys them: the prompt's
        part replaced by `cache_tokens`."""
        if self.cache_tokens is None:
            return tokens
        n = min(len(tokens), len(self.prompt_tokens))
        return list(self.cache_tokens[:n]) + list(tokens[n:])


def request_hashes(req: GenerationRequest, hasher: Any) -> list[bytes]:
    """The prompt's full-block chain (`hasher`: chain.BlockHasher), computed once and kept on the
    request; later calls return the same list."""
    if req.block_hashes is None:
        req.block_hashes = hasher.hash_blocks(req.cache_keys(req.prompt_tokens), root=req.cache_root)
    return req.block_hashes
