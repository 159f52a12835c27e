"""Tokenization of a growing chat prompt in time proportional to its new text.

An agent's turn N+1 renders to turn N's text plus a little more, and encoding the whole ~50k
characters again costs ~0.1 s a turn. A fast (Rust) Hugging Face tokenizer splits its input on
added tokens before normalizing and pre-tokenizing the pieces between them, so the ids of a text
up to the end of a special token such as <|im_end|> do not depend on what follows it. The memo
keeps a few recent (text -> ids) results with the token count at each such boundary; a new text
reuses the ids up to the last boundary inside its common prefix with a memoized text and encodes
only the rest. The result is always the ids a full encode gives (tests/engine/test_token_memo.py checks
that on many prompt pairs); a tokenizer where that cannot be shown gets no memo (memo_for: None).

Each entry also keeps where every token ends in its text, so a prefix given as text (a cache_control
mark's) is known as the prompt's tokens without encoding anything (tokens_within).

Entries are kept per principal (per_key isolation): a timing probe must not learn whether another
key's prompt shares a prefix with one's own. When the memo is full, the principal holding the most entries
gives up its least recently used one, so one key's many prompts do not push out another's.
"""

from __future__ import annotations

import json
import threading
import weakref
from array import array
from bisect import bisect_right
from collections import Counter, OrderedDict
from itertools import accumulate
from typing import Any, NamedTuple

MAX_ENTRIES = 8  # per model: a few live conversations
MAX_CHARS = 4 * 2**20  # characters held over all entries (each costs ~1-4 B of text + ~13 B per token)
MIN_REUSE_CHARS = 1024  # below this a full encode is as fast as the bookkeeping

# apply_chat_template's own parameters: template kwargs naming one of them change how it encodes
TEMPLATE_PARAMS = frozenset(
    {"tokenize", "sanitize_control_tokens", "tokenizer_kwargs", "return_dict", "padding", "truncation",
     "max_length", "return_tensors", "return_assistant_tokens_mask", "continue_final_message", "chat_template"}
)  # fmt: skip


class Entry(NamedTuple):
    text: str
    ids: list[int]
    ends: list[int]  # character offset just past each boundary token, ascending
    counts: list[int]  # number of ids up to and including that boundary token
    token_ends: array[int]  # character offset just past each id (the most so far: ascending)


class TokenMemo:
    """A per-model memo of recent encodes. `encode(text, principal)` equals
    `hf(text, add_special_tokens=False)["input_ids"]` exactly. Any thread: entries are guarded by a
    lock; the tokenizer runs outside it."""

    def __init__(
        self, hf: Any, boundary_ids: frozenset[int], max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS
    ):
        self.hf, self.boundary_ids = hf, boundary_ids
        self.max_entries, self.max_chars = max_entries, max_chars
        self.lock = threading.Lock()
        self.entries: OrderedDict[tuple[str, str], Entry] = OrderedDict()  # (principal, text), LRU last; lock
        self.num_chars = 0  # sum of the entries' text lengths; lock
        self.reused_tokens = 0  # ids taken from the memo, not encoded; lock

    def encode(self, text: str, principal: str = "") -> list[int]:
        if self.hf.split_special_tokens:  # special tokens read as text: no boundaries to trust
            return self._encode(text, 0).ids
        base, end, count = self._longest(text, principal)
        rest = self._encode(text[end:], end)
        head = Entry(text[:end], base.ids[:count], base.ends, base.counts, base.token_ends[:count]) if base else None
        entry = _joined(head, rest, end, count, text) if head else rest
        self._keep(principal, entry, base, count)
        return entry.ids

    def _encode(self, text: str, start: int) -> Entry:
        """`text` encoded alone, its boundaries shifted by `start` characters."""
        out = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(out["input_ids"]), out["offset_mapping"]
        marks = [(start + offsets[i][1], i + 1) for i, t in enumerate(ids) if t in self.boundary_ids]
        token_ends = array("i", accumulate((start + e for _, e in offsets), max, initial=start))[1:]
        return Entry(text, ids, [e for e, _ in marks], [c for _, c in marks], token_ends)

    def tokens_within(self, text: str, ids: list[int], chars: int, principal: str = "") -> int | None:
        """How many of `ids` lie wholly within the first `chars` characters of `text`, when `ids` is what
        encode gave `text` and the memo still holds it (else None): a prefix of a prompt given in text
        (a cache_control mark's) as tokens of the prompt, without encoding anything."""
        with self.lock:
            entry = self.entries.get((principal, text))
        if entry is None or entry.ids != ids:
            return None
        return bisect_right(entry.token_ends, chars)

    def _longest(self, text: str, principal: str) -> tuple[Entry | None, int, int]:
        """The memoized entry sharing the most text up to a boundary with `text`: (entry, characters,
        ids) up to that boundary; (None, 0, 0) when none shares MIN_REUSE_CHARS."""
        best: tuple[Entry | None, int, int] = (None, 0, 0)
        with self.lock:
            candidates = [e for (p, _), e in self.entries.items() if p == principal]
        for entry in candidates:
            shared = common_prefix(text, entry.text)
            k = bisect_right(entry.ends, shared)
            if k and entry.ends[k - 1] > max(best[1], MIN_REUSE_CHARS - 1):
                best = (entry, entry.ends[k - 1], entry.counts[k - 1])
        return best

    def _keep(self, principal: str, entry: Entry, base: Entry | None, reused: int) -> None:
        with self.lock:
            self.reused_tokens += reused
            if base is not None and entry.text.startswith(base.text):  # the new entry covers the old
                self._drop((principal, base.text))
            key = (principal, entry.text)
            self._drop(key)
            self.entries[key] = entry
            self.num_chars += len(entry.text)
            while self.entries and (len(self.entries) > self.max_entries or self.num_chars > self.max_chars):
                self._drop(self._victim())

    def _victim(self) -> tuple[str, str]:
        """The least recently used entry of the principal holding the most: one key's many conversations
        push out its own entries before another key's (one principal: the least recently used)."""
        held = Counter(principal for principal, _ in self.entries)
        most = max(held.values())
        return next(key for key in self.entries if held[key[0]] == most)

    def _drop(self, key: tuple[str, str]) -> None:
        gone = self.entries.pop(key, None)
        if gone is not None:
            self.num_chars -= len(gone.text)


def _joined(head: Entry, rest: Entry, end: int, count: int, text: str) -> Entry:
    """`head` (text[:end], whose boundaries up to `end` hold `count` ids) followed by `rest`."""
    k = bisect_right(head.ends, end)
    counts = head.counts[:k] + [count + c for c in rest.counts]
    return Entry(text, head.ids + rest.ids, head.ends[:k] + rest.ends, counts, head.token_ends + rest.token_ends)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search on C-speed slice compares)."""
    if a.startswith(b):
        return len(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def boundary_ids(hf: Any) -> frozenset[int]:
    """Ids of the added tokens after whose end tokenization provably splits: matched on the raw text
    (not normalized), taking no whitespace after them (rstrip) and not only between words
    (single_word: a match would depend on the next character), and inside no other added token (a
    longer match could start at the same place). Empty when the tokenizer offers none or its
    pre-tokenizer looks at a piece's place in the whole text (Metaspace's prepend_scheme "first")."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not _plain_encode(hf) or getattr(hf, "split_special_tokens", True):
        return frozenset()
    spec = json.loads(backend.to_str())
    if _uses_first_prepend(spec.get("pre_tokenizer")) or _uses_first_prepend(spec.get("normalizer")):
        return frozenset()
    added = backend.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    return frozenset(
        i
        for i, t in added.items()
        if t.content
        and not (t.normalized or t.rstrip or t.single_word)
        and sum(t.content in other for other in contents) == 1
    )


def _uses_first_prepend(spec: Any) -> bool:
    text = json.dumps(spec or {})
    return '"Metaspace"' in text and '"first"' in text


def _plain_encode(hf: Any) -> bool:
    """Whether `hf` encodes as transformers' Rust-backed tokenizer does, with no subclass preprocessing
    the text (mlx-lm's chat path calls encode, transformers' calls __call__: both must be plain)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(hf)
    return (
        isinstance(hf, TokenizersBackend)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls.encode is PreTrainedTokenizerBase.encode
        and cls._encode_plus is TokenizersBackend._encode_plus
    )


_MEMOS: weakref.WeakKeyDictionary[Any, TokenMemo | None] = weakref.WeakKeyDictionary()
_MEMOS_LOCK = threading.Lock()


def template_args(tools: list | None, template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's keyword arguments: `template_kwargs`, and `tools` only when given (a
    template that takes no tools renders as before)."""
    return dict(template_kwargs or {}) | ({"tools": tools} if tools else {})


def chat_text(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None, kwargs: Any
) -> str | None:
    """The chat template's text of `messages`, where the memo encodes it; None where the template
    must encode it itself (no memo, or a template kwarg that changes how it encodes)."""
    extra = template_args(tools, kwargs)
    if memo_for(tokenizer) is None or TEMPLATE_PARAMS & extra.keys():
        return None
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)


def chat_tokens(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None, kwargs: Any,
    principal: str,
) -> list[int]:  # fmt: skip
    """The ids of `messages` under the chat template, through `principal`'s memo where there is one."""
    text = chat_text(tokenizer, messages, add_generation_prompt, tools, kwargs)
    if text is None:
        extra = template_args(tools, kwargs)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra))
    memo = memo_for(tokenizer)
    assert memo is not None
    return memo.encode(text, principal)


def memo_for(tokenizer: Any) -> TokenMemo | None:
    """The memo of this tokenizer (an mlx-lm TokenizerWrapper or a Hugging Face tokenizer), made on
    first use; None when its encodes cannot be shown to split at special tokens (slow or custom
    tokenizers, subclasses that preprocess text, no usable special tokens)."""
    try:
        with _MEMOS_LOCK:
            if tokenizer in _MEMOS:
                return _MEMOS[tokenizer]
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        ids = boundary_ids(hf)
        memo = TokenMemo(hf, ids) if ids else None
        with _MEMOS_LOCK:
            _MEMOS[tokenizer] = memo
        return memo
    except Exception:  # an odd tokenizer (or one no weak reference can name): no memo, never a failed request
        return None
