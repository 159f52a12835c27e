"""The engine's side of block caching: look up and assemble before prefill, register after.

Runs on the worker thread (it touches MLX). When the model's cache cannot be cut into blocks,
`enabled` is False, `reason` says why, and every request simply starts from an empty cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...kv import blocks, runs
from ...kv.base import Block, MatchResult, NewBlock
from ...kv.manager import KVManager
from ...kv.salts import tail_parent
from ..request import GenerationRequest, request_hashes
from .front_prefill import FrontPrefill
from .message_starts import message_starts

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Prepared:
    """One request's assembled prefix. `holding`: the request still holds background SSD writes
    (from lookup to its first token). `captures`: checkpoints taken while its prompt was
    prefilled (recurrent states, window contents), registered as tails with its blocks."""

    prompt_cache: list[Any]
    match: MatchResult
    holding: bool = True
    captures: list[blocks.Capture] = field(default_factory=list)
    tails_done: set[int] = field(default_factory=set)  # ends of the tails registered so far
    registered_blocks: int = 0  # full blocks before this index are registered (or were cached)
    direct_done: bool = False  # the blocks read into the request's buffers (match.direct) are registered
    deferred: list[Block] = field(default_factory=list)  # registered, not yet handed to the SSD tier
    deferred_at_flush: int = 0  # manager.num_flushes when they were registered
    prompt_hashes: list[bytes] = field(default_factory=list)  # the prompt's chain (GenerationRequest.block_hashes)
    root: bytes | None = None  # the principal's chain root (kv/salts.py); None: the plain namespace


class PrefixCache:
    def __init__(
        self,
        model: Any,
        manager: KVManager | None,
        reason: str = "",
        ssd_tier: Any = None,
        layout: blocks.CacheLayout | None = None,
        checkpoint_every: int = 0,
        turn_marker: int | None = None,
        folder_owner: str | None = None,
        front: FrontPrefill | None = None,
        agree: Any = None,
    ):
        self.model = model
        # Set when another server owns the cache folder and this one is its guest ("pid N"): pins
        # and the SSD flush belong to the owner (kv/ssd/folder_lock.py).
        self.folder_owner = folder_owner
        self.manager = manager
        bs = manager.block_size if manager is not None else 1
        self.layout = layout if layout is not None else blocks.cache_layout(model, bs)
        # Models whose prefixes are usable only where something was captured (recurrent states,
        # window contents) take checkpoints during prefill: every `checkpoint_every` tokens (a
        # multiple of the block size), where a request asks, and at the end of each prompt.
        self.checkpoint_every = -(-checkpoint_every // bs) * bs if checkpoint_every > 0 else 0
        self.turn_marker = turn_marker  # the token opening each chat message (engine/cache/message_starts.py)
        # Distributed: every rank's cached length for a lookup (a collective; engine/distributed.py).
        # Set, the ranks agree on the shortest before prefill.
        self.agree = agree
        self.reason = reason
        # An SSD hit's first blocks computed while the rest are read (engine/cache/front_prefill.py),
        # for plain-KV layouts with an SSD tier.
        self.front = front
        self.ssd_tier = ssd_tier  # kv.ssd.SSDTier or None; the engine closes it at shutdown
        self._hold_lock = threading.Lock()  # guards _num_holding
        self._num_holding = 0  # requests between lookup and first token: writes resume when none is left

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def lookup_hashes(self, req: GenerationRequest) -> list[bytes]:
        """The hashes of `req`'s prompt blocks a lookup may use (it leaves the last token to prefill),
        read from the chain kept on the request; [] while block caching is off."""
        if self.manager is None:
            return []
        usable = max(0, len(req.prompt_tokens) - 1)
        return request_hashes(req, self.manager.hasher)[: usable // self.manager.block_size]

    def cached_in_ram(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the RAM tier holds now."""
        return leading_blocks(hashes, self.manager.in_ram) if self.manager is not None else 0

    def uncached_tokens(self, req: GenerationRequest) -> int:
        """Prompt tokens `req` would prefill if it started now (its leading blocks in RAM or on the
        SSD count as cached)."""
        manager = self.manager
        if manager is None:
            return len(req.prompt_tokens)
        tier = manager.next_tier
        hashes = request_hashes(req, manager.hasher)
        held = leading_blocks(hashes, lambda h: manager.in_ram(h) or (tier is not None and tier.contains(h)))
        return len(req.prompt_tokens) - held * manager.block_size

    def prepare(
        self, prompt: Sequence[int], hashes: Sequence[bytes] | None = None, root: bytes | None = None
    ) -> Prepared:
        """A prompt cache holding the longest cached prefix of `prompt`, always leaving at least
        one token to prefill (its logits pick the first generated token). Background SSD writes
        are held from here until `first_token` (or `finish` / `release`). `root`: the principal's
        (GenerationRequest.cache_root), for its tails and the blocks after its prompt."""
        if self.ssd_tier is not None:
            with self._hold_lock:
                self._num_holding += 1
            self.ssd_tier.hold_writes()
        if self.manager is None:
            return Prepared(self.layout.assemble([]), MatchResult([], 0))
        distributed = self.agree is not None  # ranks must read the same blocks in step
        match = self.manager.lookup(
            prompt,
            max_tokens=len(prompt) - 1,
            front=None if distributed else self.front,
            hashes=hashes,
            root=root,
            # The SSD's blocks read straight into this request's cache, which gives them to RAM later.
            positions=None if distributed else self.layout.direct_positions(len(prompt)),
        )
        if distributed:
            match = self._agree(prompt, match)
        try:
            cache = self.layout.assemble(
                [b.payload for b in match.blocks],
                match.tail_payload,
                match.tail_tokens,
                match.tail_len,
                # Room for the rest: a request joining the batch alone (kv/cache_fill.py merge_alone) or
                # directly (engine/batch/direct_join.py) writes it in place; growing would copy the whole
                # prefix. mlx-lm's merge of several requests copies only their filled positions. One
                # more for the first generated token: mlx-lm runs its decode step before it reports that
                # token, and a prompt filling the buffer exactly would grow (copy) it inside the TTFT.
                room=len(prompt) - match.num_tokens + 1,
                direct=[b.payload for b in match.direct],
            )
        except Exception:
            self.manager.release(match.blocks)
            self.first_token()
            raise
        return Prepared(cache, match, prompt_hashes=list(hashes or ()), root=root)

    def _agree(self, prompt: Sequence[int], match: MatchResult) -> MatchResult:
        """The longest prefix every rank has: while the ranks' cached lengths differ, those above
        the shortest look up again within it (each round is one collective on every rank; the
        longest length only falls, so it ends)."""
        while True:
            lengths = self.agree(match.num_tokens)
            shortest = min(lengths)
            if shortest == max(lengths):
                return match
            if match.num_tokens > shortest:
                self.manager.release(match.blocks)
                match = self.manager.lookup(prompt, max_tokens=shortest)

    def checkpoints(self, prompt: Sequence[int], cached: int, asked: Sequence[int] = ()) -> list[int]:
        """Where to capture while prefilling prompt[cached:]: every `checkpoint_every` tokens,
        where its last messages start (and at the positions the request asks for), and at
        len(prompt) - 1 (the longest prefix a repeat of the prompt may use). Empty for models
        whose every block chain is usable."""
        if self.manager is None or not self.layout.needs_checkpoints:
            return []
        prompt_len = len(prompt)
        points = set(asked) | set(message_starts(prompt, self.turn_marker, cached)) | {prompt_len - 1}
        if self.checkpoint_every:
            points.update(range(self.checkpoint_every, prompt_len, self.checkpoint_every))
        return sorted(p for p in points if cached < p < prompt_len)

    def capture(self, prepared: Prepared, prompt_cache: list[Any], position: int) -> None:
        """Keep a checkpoint of `prompt_cache`, which holds the prompt's first `position` tokens."""
        prepared.captures.append(self.layout.capture(prompt_cache, position))

    def _keep_tail(
        self, prepared: Prepared, tokens: list[int], end: int, hashes: list[bytes], state: blocks.Capture | None
    ) -> None:
        """Keep tokens[start:end] as a tail, where start is the block boundary a later lookup of
        tokens[:end] (which may use at most end - 1 tokens) stops at. 1..block_size tokens.
        `state`: the checkpoint at `end` (recurrent layers), when the layout has one."""
        if end < 1 or end in prepared.tails_done:
            return
        prepared.tails_done.add(end)
        manager, bs = self.manager, self.manager.block_size
        num_blocks = (end - 1) // bs
        parent = tail_parent(hashes[num_blocks - 1] if num_blocks else manager.hasher.namespace, prepared.root)
        payload, nbytes = self.layout.slice_tail(prepared.prompt_cache, num_blocks * bs, end, state, prepared.captures)
        manager.cache_tail(parent, tokens[num_blocks * bs : end], payload, nbytes)

    def first_token(self) -> None:
        """One request's prefill is done: background SSD writes go on once no other request is
        between its lookup and its first token. Called once per `prepare` (use `mark_first_token`)."""
        if self.ssd_tier is None:
            return
        with self._hold_lock:
            self._num_holding = max(0, self._num_holding - 1)
            if self._num_holding:
                return
        self.ssd_tier.resume_writes()

    def mark_first_token(self, prepared: Prepared) -> None:
        """`first_token` for this request, once (later calls do nothing)."""
        if prepared.holding:
            prepared.holding = False
            self.first_token()

    def release(self, prepared: Prepared) -> None:
        """Drop the request's references without registering what it computed (the request failed
        or was cancelled). The blocks it read straight into its cache still join RAM: they are the
        SSD's, verified, and nothing it wrote reaches their positions."""
        self.mark_first_token(prepared)
        if self.manager is None:
            return
        try:
            self.register_direct(prepared)
        except Exception as exc:  # its cache's arrays failed to evaluate: they are read again next time
            log.warning("the blocks a failed request read from the SSD are left out of RAM: %s", exc)
        finally:
            self.manager.release(prepared.match.blocks)

    def finish(self, prepared: Prepared, kv_tokens: Sequence[int], prompt_len: int) -> int:
        """Release the request's blocks and register every new full block of the tokens whose
        KV the cache now holds, plus tails ending at the prompt's end and at the sequence's end.
        Blocks an earlier `register(write=False)` kept off the SSD go to it now. Returns the number
        of blocks registered."""
        self.mark_first_token(prepared)
        if self.manager is None:
            return 0
        try:
            if prepared.deferred and prepared.deferred_at_flush == self.manager.num_flushes:
                self.manager.write_deferred(prepared.deferred)  # unless a flush dropped them meanwhile
            prepared.deferred = []
            self.register_direct(prepared)
            return self.register(prepared, kv_tokens, prompt_len)
        finally:
            self.manager.release(prepared.match.blocks)

    def register(
        self, prepared: Prepared, kv_tokens: Sequence[int], prompt_len: int, write: bool = True, upto: int | None = None
    ) -> int:
        """Register every new full block of `kv_tokens` (the tokens whose KV and state
        `prepared.prompt_cache` holds) up to `upto` tokens (default: all), plus tails: for plain
        attention models at the prompt's end and the sequence's end, for others at each checkpoint
        captured and at the sequence's end (where the cache's own state is). The request keeps its
        references (it registers its prompt's blocks once its prefill is done, then the rest at
        `finish`; blocks registered before are not again, even if evicted meanwhile).
        `write=False` keeps the new blocks off the SSD until `finish` (a write during the request's
        decode would compete with it). The blocks read into the request's cache (match.direct) are
        not among them: `register_direct`. Returns the number of blocks registered."""
        if self.manager is None:
            return 0
        manager, layout = self.manager, self.layout
        bs = manager.block_size
        held = layout.cache_length(prepared.prompt_cache)
        length = min(
            len(kv_tokens) if held is None else held, len(kv_tokens), upto if upto is not None else len(kv_tokens)
        )
        tokens = list(kv_tokens[:length])
        num_full = length // bs
        first = max(len(prepared.match.blocks) + len(prepared.match.direct), prepared.registered_blocks)
        # For blocks and tails; the request's own chain (`known`) goes on past its prompt.
        hashes = manager.hasher.hash_blocks(tokens, num_full, known=prepared.prompt_hashes, root=prepared.root)
        todo = manager.new_blocks(tokens, first, num_full, hashes)
        added = 0
        sliced: dict[int, tuple[Any, int]] = {}
        for start, end in _stretches([index for index, _, _ in todo]):  # one run each (kv/runs.py), no gaps held
            cut = layout.slice_blocks(prepared.prompt_cache, start, end, bs, prepared.captures)
            sliced.update(zip(range(start, end), cut, strict=True))
        new = [
            NewBlock(block_hash, parent, tuple(tokens[index * bs : (index + 1) * bs]), *sliced[index], index)
            for index, block_hash, parent in todo
        ]
        # The whole chain up to its last new block: RAM keeps its head before its deep end.
        for block in manager.cache_blocks(new, hashes[:num_full], write=write):
            added += 1
            if not write:
                prepared.deferred.append(replace(block, ref_count=0, last_access=0, meta={}))  # RAM's own stays apart
                prepared.deferred_at_flush = manager.num_flushes
        prepared.registered_blocks = max(prepared.registered_blocks, num_full)
        for end, state in sorted(self._tail_ends(prepared, tokens, len(kv_tokens), prompt_len).items()):
            self._keep_tail(prepared, tokens, end, hashes, state)
        return added

    def register_direct(self, prepared: Prepared) -> None:
        """Put the blocks the SSD read into the request's own buffers (match.direct) into RAM, as
        views of those buffers: no copy (the SSD has them). Once the request is done, or earlier for
        other requests (Scheduler: its prompt's blocks registered while others are about, or a new
        request sharing them): then its next write into its cache copies it (mlx copies an array
        that a view shares), as promoting them at the lookup made it copy before its first token.
        Once per request."""
        match = prepared.match
        if not match.direct or prepared.direct_done:
            return
        prepared.direct_done = True
        runs.materialize([b.payload for b in match.direct], self.manager.block_size)
        start = len(match.blocks)
        new = [
            NewBlock(b.block_hash, b.parent_hash, b.token_ids, b.payload, b.nbytes, start + i)
            for i, b in enumerate(match.direct)
        ]
        self.manager.cache_blocks(new, [b.block_hash for b in (*match.blocks, *match.direct)], read=True)
        runs.settle(match.direct[0].payload.run)

    def _tail_ends(self, prepared: Prepared, tokens: list[int], held: int, prompt_len: int) -> dict[int, Any]:
        """Where to keep tails (ends up to len(tokens)), each with its checkpoint (None for plain models).
        `held`: how many tokens the cache's own state reflects. Plain models keep one at the prompt's
        end, at the sequence's end, and where each of the prompt's new messages starts: another
        question under the same messages shares the prompt up to there, inside a block the chain
        cannot give it (it diverges within; a 64-token block loses 32 tokens on average)."""
        length = len(tokens)
        if not self.layout.needs_checkpoints:
            starts = message_starts(tokens[: min(prompt_len, length)], self.turn_marker, prepared.match.num_tokens)
            return {end: None for end in {min(prompt_len, length), length, *starts}}
        ends: dict[int, Any] = {c.position: c for c in prepared.captures if c.position <= length}
        if held == length:  # the cache's own state is at the sequence's end
            ends[length] = self.layout.capture(prepared.prompt_cache, length) if self.layout.has_state else None
        return ends


def _stretches(indices: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each stretch of consecutive numbers in the ascending `indices`."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def leading_blocks(hashes: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
    """How many leading blocks of `hashes` are `held`."""
    n = 0
    for h in hashes:
        if not held(h):
            break
        n += 1
    return n
