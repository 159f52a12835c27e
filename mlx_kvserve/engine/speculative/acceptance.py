"""How a verify pass decides which drafted tokens to keep, per request sampling mode.

Every rule here emits tokens distributed exactly as plain decoding's:

- **Greedy**: the target's argmax at each position; drafts are kept while they equal it.
- **Sampled, deterministic draft** (prompt lookup: p_draft = 1 at the drafted token): the target is
  sampled at each position, drafts are kept while they equal the sample. That is the standard rule
  below with p_draft a point mass (accept x with prob p_target(x); on rejection sample from p_target
  without x, which is what a fresh sample that differs from x is).
- **Sampled, draft model, no seed**: the standard speculative-sampling rule (Leviathan et al.,
  Chen et al.): accept draft x with probability min(1, p_target(x) / p_draft(x)); at the first
  rejection sample from normalize(max(0, p_target - p_draft)); after k acceptances, sample the next
  token from p_target.
- **Sampled, with a seed**: each generated position n has its own key, the one the batch's seeded
  sampler (engine/sampling/sampler.py) would draw token n with; the draft model draws with the same key as
  the target (shared Gumbel noise), and the target's own draw at that key is the token. So a seeded
  request's output depends on its seed alone: not on k, not on the draft, not on whether it
  speculated at all (the batch path draws the same tokens). The price is a lower acceptance rate
  than the standard rule's where the draft and target distributions differ.

p_target and p_draft are the request's filtered distributions (top_p, min_p, top_k, temperature, in
the batch sampler's order).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

from ..request import SamplingParams
from ..sampling.sampler import filtered, make_request_sampler


class Verdict(NamedTuple):
    """A verify pass's outcome: the tokens to emit (the accepted drafts, then one token from the
    target) and how many drafts were accepted."""

    tokens: list[int]
    accepted: int


def sampling_logits(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Rows of logprobs [n, V] as the batch's sampler draws from them: filtered, over temperature."""
    return filtered(logprobs, params) * (1.0 / params.temperature)


class KeyChain:
    """A seeded request's per-position draw keys, the chain engine/sampling/sampler.py's seeded sampler
    walks (one split per token: the first half carries on, the second draws)."""

    def __init__(self, seed: int, position: int = 0):
        self.key = mx.random.key(seed)
        for i in range(position):
            self.key = mx.random.split(self.key)[0]
            if i % 256 == 255:  # keep the lazy graph shallow for long requests
                mx.eval(self.key)
        self._ahead: list[tuple[mx.array, mx.array]] = []  # (chain key after, draw key) from `key`

    def draws(self, n: int) -> list[mx.array]:
        """The draw keys of the next n positions (the chain does not move: see `advance`)."""
        key = self._ahead[-1][0] if self._ahead else self.key
        while len(self._ahead) < n:
            carry, draw = mx.random.split(key)
            self._ahead.append((carry, draw))
            key = carry
        return [draw for _, draw in self._ahead[:n]]

    def advance(self, n: int) -> None:
        """Move past n positions (their tokens were emitted)."""
        if n <= 0:
            return
        self.draws(n)
        self.key = self._ahead[n - 1][0]
        self._ahead = []


class Acceptance:
    """One request's acceptance rule (see the module docstring). `pick_draft` samples a draft
    model's token; `verify` judges a pass; `advance` moves a seeded request's keys past what was
    emitted. The last drafts' rows are kept between `pick_draft` and `verify` (unseeded sampled)."""

    def __init__(self, params: SamplingParams, position: int):
        self.params = params
        self.greedy = params.temperature == 0
        self.keys = KeyChain(params.seed, position) if not self.greedy and params.seed is not None else None
        self._draft_probs: list[mx.array] = []  # p_draft rows of the pending drafts (standard rule only)

    def pick_draft(self, logprobs: mx.array, i: int) -> mx.array:
        """The draft model's token at draft position i (0-based) from its logprobs row [1, V]: shape [1]."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        logits = sampling_logits(logprobs, self.params)
        if self.keys is not None:
            return mx.random.categorical(logits, key=self.keys.draws(i + 1)[i])
        self._draft_probs.append(mx.softmax(logits, axis=-1)[0])
        return mx.random.categorical(logits)

    def verify(self, logprobs: mx.array, draft: list[int]) -> Verdict:
        """The target's rows [len(draft) + 1, V] (row i predicts the token after draft[:i]) against the drafts."""
        draft_probs, self._draft_probs = self._draft_probs, []
        if self.greedy:
            return _keep_while_equal(mx.argmax(logprobs, axis=-1).tolist(), draft)
        logits = sampling_logits(logprobs, self.params)
        if self.keys is not None:  # each row as the batch would draw it: shape [1, V], the position's key
            keys = self.keys.draws(len(draft) + 1)
            picks = [mx.random.categorical(logits[i : i + 1], key=keys[i]) for i in range(len(draft) + 1)]
            return _keep_while_equal(mx.concatenate(picks).tolist(), draft)
        if not draft_probs:  # a deterministic draft (prompt lookup)
            return _keep_while_equal(mx.random.categorical(logits).tolist(), draft)
        # the drafts may have been cut (a grammar refused one): their rows are the first ones
        return standard_rule(mx.softmax(logits, axis=-1), mx.stack(draft_probs[: len(draft)]), draft)

    def advance(self, n: int) -> None:
        if self.keys is not None:
            self.keys.advance(n)


def standard_rule(target: mx.array, drafted: mx.array, draft: list[int]) -> Verdict:
    """Speculative sampling's acceptance: `target` [k + 1, V] and `drafted` [k, V] are the target's
    and the draft's probabilities, `draft` the k tokens drawn from `drafted` (global random state)."""
    k = len(draft)
    drafted = _width(drafted, target.shape[-1])
    ids = mx.array(draft)[:, None]
    p = mx.take_along_axis(target[:k], ids, axis=-1)[:, 0]
    q = mx.take_along_axis(drafted, ids, axis=-1)[:, 0]
    accept = (mx.random.uniform(shape=(k,)) * q < p).tolist()  # u < p / q, without dividing by q = 0
    n = next((i for i, ok in enumerate(accept) if not ok), k)
    row = target[n]
    if n < k:
        residual = mx.maximum(row - drafted[n], 0.0)
        row = mx.where(mx.sum(residual) > 0, residual, row)  # p = q to the last bit: nothing to correct
    token = mx.random.categorical(mx.log(row)).item()
    return Verdict([*draft[:n], token], n)


def resumed_sampler(params: SamplingParams, position: int) -> Any:
    """The batch sampler of a request that goes back into the batch with `position` tokens
    generated: a seeded one continues its key chain there (None for greedy)."""
    sampler = make_request_sampler(params)
    if sampler is not None and sampler.key is not None:
        sampler.key = KeyChain(params.seed, position).key
    return sampler


def _keep_while_equal(targets: list[int], draft: list[int]) -> Verdict:
    n = 0
    while n < len(draft) and targets[n] == draft[n]:
        n += 1
    return Verdict(targets[: n + 1], n)


def _width(rows: mx.array, width: int) -> mx.array:
    """Rows cut or zero-padded to `width` columns (a draft model may score a padded vocabulary)."""
    have = rows.shape[-1]
    if have == width:
        return rows
    if have > width:
        return rows[..., :width]
    return mx.concatenate([rows, mx.zeros((rows.shape[0], width - have), rows.dtype)], axis=-1)
