"""Partial last blocks ("tails"), kept in RAM so an exact repeat or a new question does not
re-prefill up to block_size tokens that the block chain cannot hold (a lookup may use at most
len(prompt) - 1 tokens, so a prompt ending on a block boundary loses its whole last block).

A tail hangs off the hash of the full block before it (or the namespace, for prompts shorter
than a block). Because the KV of position i depends only on tokens 0..i, any prefix of a tail's
tokens is usable: a lookup takes the longest common prefix of the prompt's remainder with any
tail under that parent. Tails are never pinned; the SSD tier keeps copies (kv/ssd/tails.py). Not
thread-safe: KVManager's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple


class Tail(NamedTuple):
    parent_hash: bytes
    token_ids: tuple[int, ...]
    payload: Any
    nbytes: int


class TailMatch(NamedTuple):
    tail: Tail
    num_tokens: int  # how many of the tail's tokens the prompt shares


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TailStore:
    """At most `per_parent` tails per parent, LRU over all tails within `max_bytes`.

    `exact`: a tail is usable only whole (it carries a checkpoint, a state at its very end), so
    a lookup takes only tails all of whose tokens the prompt shares, and a longer tail never
    replaces the shorter ones it extends."""

    def __init__(self, max_bytes: int, per_parent: int = 4, exact: bool = False):
        self.max_bytes = max_bytes
        self.per_parent = per_parent
        self.exact = exact
        self._tails: OrderedDict[tuple[bytes, tuple[int, ...]], Tail] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._tails)

    def __iter__(self):
        return iter(list(self._tails.values()))

    def check(self, block_size: int) -> None:
        """Raise AssertionError if the books do not balance: bytes, budget, tail sizes."""
        tails = list(self)
        assert sum(t.nbytes for t in tails) == self.used_bytes, "tail bytes do not add up"
        assert self.used_bytes <= self.max_bytes, "tails over budget"
        assert all(0 < len(t.token_ids) <= block_size for t in tails), "tail of wrong size"

    def _siblings(self, parent_hash: bytes) -> list[Tail]:
        return [t for (p, _), t in self._tails.items() if p == parent_hash]

    def match(self, parent_hash: bytes, rest: Sequence[int]) -> TailMatch | None:
        """The tail under `parent_hash` sharing the longest prefix with `rest` (>= 1 token)."""
        best: TailMatch | None = None
        for tail in self._siblings(parent_hash):
            n = common_prefix(tail.token_ids, rest)
            if self.exact and n < len(tail.token_ids):
                continue
            if n and (best is None or n > best.num_tokens):
                best = TailMatch(tail, n)
        if best is not None:
            self._tails.move_to_end((parent_hash, best.tail.token_ids))
        return best

    def add(self, tail: Tail) -> bool:
        """Store a tail unless an existing one already covers it; drop tails it covers."""
        if tail.nbytes > self.max_bytes:
            return False
        siblings = self._siblings(tail.parent_hash)
        if self.exact:
            if any(s.token_ids == tail.token_ids for s in siblings):
                return False
        else:
            if any(common_prefix(s.token_ids, tail.token_ids) == len(tail.token_ids) for s in siblings):
                return False
            for s in siblings:
                if common_prefix(s.token_ids, tail.token_ids) == len(s.token_ids):
                    self._remove(s)
        remaining = self._siblings(tail.parent_hash)
        for s in remaining[: max(0, len(remaining) + 1 - self.per_parent)]:
            self._remove(s)
        self._tails[(tail.parent_hash, tail.token_ids)] = tail
        self.used_bytes += tail.nbytes
        while self.used_bytes > self.max_bytes:
            self._remove(next(iter(self._tails.values())))
        return True

    def clear(self) -> None:
        self._tails.clear()
        self.used_bytes = 0

    def _remove(self, tail: Tail) -> None:
        if self._tails.pop((tail.parent_hash, tail.token_ids), None) is not None:
            self.used_bytes -= tail.nbytes
