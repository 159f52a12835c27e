"""Draft-model speculation ([speculative] draft_model): a small model with the served model's
tokenizer drafts the next k tokens, which the served model verifies in one pass
(engine/speculative/speculator.py).

The draft keeps its own mlx-lm KV cache in step with the target's, as mlx-lm's
`speculative_generate_step` does: after a verify pass its cache is trimmed to the tokens that were
kept, and a token it has not seen yet (the target's bonus token, or the last accepted draft) is
fed at the start of the next draft. While the adaptive depth drafts nothing, the draft falls
behind and catches up at its next draft (in prefill-sized chunks).

Its prompt KV is cached in blocks too, under its own namespace (its fingerprint, marked as a
draft), in RAM only: when a request goes solo the draft looks its prompt up there and prefills
only the rest; when the request ends (or goes back into the batch) the draft's blocks are
registered, so a repeat of the prompt, or the next turn of the conversation, skips the draft's
prefill as well. They are not written to the SSD: the draft is small, its prefill cheap next to
the target's, and a restart costs one draft prefill per prompt.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...chain import BlockHasher
from ...config import Config, default_home
from ...errors import ConfigError
from ...kv import blocks
from ...kv.hashing import model_fingerprint, namespace_hash
from ...kv.manager import KVManager
from ...kv.ram import RAMStore
from ...kv.tails import TailStore
from ..cache.prefix_cache import PrefixCache, Prepared
from .acceptance import Acceptance

log = logging.getLogger(__name__)

RAM_SHARE = 8  # the draft's blocks get 1/RAM_SHARE of the RAM budget the served model's blocks get


class DraftModel:
    """The draft model, its cache layout (plain attention: trimmable) and its block cache (None:
    every request prefills the draft from scratch). `open` starts a request's draft."""

    def __init__(self, model: Any, name: str, prefix_cache: PrefixCache | None = None, prefill_step: int = 512):
        self.model = model
        self.name = name
        self.prefix_cache = prefix_cache
        self.prefill_step = prefill_step
        self.layout = prefix_cache.layout if prefix_cache is not None else blocks.cache_layout(model, 64)
        if self.layout.has_state or self.layout.has_window:
            raise ConfigError(
                f"speculative.draft_model {name}: its cache cannot be rewound (recurrent or sliding-window "
                "layers); a draft model needs plain attention"
            )

    def open(self, prompt: Sequence[int], seq: Sequence[int], root: bytes | None = None) -> DraftRun:
        """A draft for a request whose sequence is `seq` (prompt, then the tokens generated so far):
        its cached prompt blocks (in the chain of the request's principal, `root`), then a prefill of
        seq[:-1]. Raises what the model raises."""
        prepared = self.prefix_cache.prepare(list(prompt), None, root) if self.prefix_cache is not None else None
        cache = prepared.prompt_cache if prepared is not None else self.layout.new_cache()
        cached = prepared.match.num_tokens if prepared is not None else 0
        run = DraftRun(self, cache, list(seq[:cached]), len(prompt), prepared)
        try:
            run.catch_up(list(seq[:-1]))
        except Exception:
            run.close(keep=False)
            raise
        return run


class DraftRun:
    """One request's draft: `cache` holds the KV of `fed`, a prefix of the request's sequence."""

    def __init__(self, draft: DraftModel, cache: list[Any], fed: list[int], prompt_len: int, prepared: Prepared | None):
        self.draft = draft
        self.cache = cache
        self.fed = fed
        self.prompt_len = prompt_len
        self.prepared = prepared
        self._drafted: list[int] = []  # tokens fed while drafting, not yet settled (their KV is in `cache`)
        self.cached_tokens = len(fed)  # prompt tokens its block cache held when it opened

    def catch_up(self, tokens: list[int]) -> None:
        """Feed tokens[len(fed):] (`fed` is a prefix of `tokens`) in prefill-sized chunks."""
        step = self.draft.prefill_step
        while len(self.fed) < len(tokens):
            chunk = tokens[len(self.fed) : len(self.fed) + step]
            self.draft.model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.fed.extend(chunk)

    def propose(self, seq: list[int], k: int, acceptance: Acceptance) -> mx.array:
        """k tokens that may follow `seq`, drawn by `acceptance`'s rule (lazy: evaluated with the
        verify pass). The tokens of `seq` the draft has not seen go in first."""
        if k <= 0:
            return mx.array([], mx.uint32)
        if len(seq) - len(self.fed) > self.draft.prefill_step:
            self.catch_up(seq[:-1])
        y = mx.array(seq[len(self.fed) :], mx.uint32)
        self.fed = list(seq)
        tokens = []
        for i in range(k):
            logits = self.draft.model(y[None], cache=self.cache)[0, -1:]
            y = acceptance.pick_draft(logits - mx.logsumexp(logits, axis=-1, keepdims=True), i).astype(mx.uint32)
            tokens.append(y)
        self._drafted = [-1] * (k - 1)  # the last draft was never fed; values come in settle
        return mx.concatenate(tokens)

    def settle(self, draft: list[int], seq: list[int]) -> None:
        """After the verify pass (`seq`: the sequence with the tokens it emitted): keep the KV of
        the drafts the target kept, trim the rest."""
        fed_drafts = draft[: len(self._drafted)]
        self._drafted = []
        keep = 0
        base = len(self.fed)
        while keep < len(fed_drafts) and base + keep < len(seq) - 1 and seq[base + keep] == fed_drafts[keep]:
            keep += 1
        if len(fed_drafts) > keep:
            for c in self.cache:
                c.trim(len(fed_drafts) - keep)
        self.fed.extend(fed_drafts[:keep])

    def close(self, keep: bool = True) -> None:
        """Register the draft's new blocks (`keep`) or only release the cached ones it used
        (the request failed: its cache may be half updated). Once; never raises."""
        prepared, self.prepared = self.prepared, None
        if prepared is None or self.draft.prefix_cache is None:
            return
        try:
            if keep:
                self.draft.prefix_cache.finish(prepared, self.fed, self.prompt_len)
            else:
                self.draft.prefix_cache.release(prepared)
        except Exception:
            log.exception("the draft model's KV blocks could not be registered")


def check_compatible(tokenizer: Any, draft_tokenizer: Any, name: str) -> None:
    """Raise ConfigError unless the draft's tokenizer maps every token to the same id as the
    served model's (drafted ids are fed to the served model as they are)."""
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours == theirs:
        return
    moved = sum(1 for token, i in theirs.items() if ours.get(token) != i)
    raise ConfigError(
        f"speculative.draft_model {name}: its tokenizer is not the served model's ({len(theirs)} tokens vs "
        f"{len(ours)}; {moved} have no id or another id in the served model's); a draft model must share "
        "the served model's tokenizer"
    )


def draft_block_cache(model: Any, fingerprint: str, block_size: int, ram_bytes: int) -> PrefixCache | None:
    """A RAM-only block cache for the draft's prompt KV, in a namespace of its own (None when
    its layout cannot be cut into blocks)."""
    layout = blocks.cache_layout(model, block_size)
    if not layout.supported:
        return None
    namespace = namespace_hash(fingerprint, layout.kv_dtype, block_size, cache_layout=layout.signature + "|draft")
    manager = KVManager(
        BlockHasher(namespace, block_size), RAMStore(ram_bytes - ram_bytes // 8), TailStore(ram_bytes // 8)
    )
    return PrefixCache(model, manager, layout=layout)


def draft_ram_share(config: Config, text_alone: bool) -> tuple[Config, int]:
    """The draft's prompt KV inside the memory plan's KV cache budget, not beside it: `config` with the
    served model's block budget less the draft's share (1/(RAM_SHARE + 1) of it), and that share; (config,
    0) when no draft is loaded with a block cache (none set, the cache off, or not a text model alone)."""
    total = config.cache.ram_max_bytes
    if not (text_alone and config.speculative.draft_model and config.cache.enabled and total):
        return config, 0
    share = total // (RAM_SHARE + 1)
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, ram_max_bytes=total - share)), share


def load_draft(config: Config, tokenizer: Any, prefill_step: int, ram_bytes: int = 0) -> DraftModel | None:
    """The [speculative] draft_model (None when unset), checked against the served model's
    `tokenizer`, prefilling `prefill_step` tokens a pass as the served model does (passed in: build.py
    is above this module), its blocks cached in `ram_bytes` of RAM (`draft_ram_share`; 0: a
    RAM_SHARE-th of the served model's). Raises ConfigError (another tokenizer, a layout that cannot
    be rewound) or ModelLoadError (it cannot be found or read)."""
    spec = config.speculative.draft_model
    if not spec:
        return None
    from mlx_lm.utils import load

    from ...errors import ModelLoadError
    from ...models.loader import resolve_model_path
    from ..memory.device import array_memory_bytes

    name, path = resolve_model_path(spec, config.models_path(), config.model.dtype)
    try:
        model, draft_tokenizer = load(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the draft model from {path}: {exc}") from exc
    try:
        check_compatible(tokenizer, draft_tokenizer, name)
    except ConfigError as exc:
        if config.speculative.mode == "draft":
            raise
        # "auto": a served model the draft does not fit (another of the [[models]]) drafts by prompt lookup
        log.warning("draft model not used for this model: %s", exc)
        return None
    cache = None
    if config.cache.enabled:
        budget = ram_bytes or (config.cache.ram_max_bytes or array_memory_bytes() // 4) // RAM_SHARE
        fingerprint = model_fingerprint(path, default_home() / "fingerprints.json")
        cache = draft_block_cache(model, fingerprint, config.cache.block_size, budget)
    log.info("draft model %s loaded from %s (its prompt KV cached in RAM: %s)", name, path, cache is not None)
    return DraftModel(model, name, cache, prefill_step)
