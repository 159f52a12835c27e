"""Speculative decoding for a request that decodes alone (prompt lookup), on the worker thread.

mlx-lm's BatchGenerator steps every row by one token, so it cannot verify k drafted tokens per row.
While one request runs alone (nothing else in the batch, waiting or pending: the local single-user
case, where decode is the bottleneck) the scheduler takes its KV out of the batch and hands it to
`Speculator`, which decodes it on its plain per-request cache: draft k tokens from the longest
recent n-gram match in prompt + output (`PromptLookup`), run the last token and the k drafts through
the model in one forward pass, keep the longest prefix the target itself would have produced
(argmax at each position), then trim the cache's rejected positions. When another request arrives
the scheduler puts the request back into the batch (`rejoin`).

Greedy only: a greedy request's tokens are the target's argmax at every position, with or without
drafts. Sampled, constrained (json_schema / grammar), penalised or logit_bias requests stay on the
batch path; so do layouts whose cache cannot be rewound: recurrent layers (no checkpoint per
position), sliding windows (a rotated window cannot be trimmed) and rounded KV (cache.kv_bits).

`AdaptiveDepth` picks k per verify pass (0 = a plain one-token step): the expected tokens a pass
yields, from the request's acceptance rate, over the measured cost of a pass that wide, against the
measured cost of a one-token step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx

from .request import SamplingParams

MODES = ("auto", "off", "prompt_lookup")
MARGIN = 0.1  # a pass with drafts must promise this much more than a plain step: measured costs are noisy


@dataclass
class SpeculationStats:
    """Counters since start (read by /health and /metrics from other threads: plain ints)."""

    solo_requests: int = 0  # requests that decoded alone on the speculative path
    rejoins: int = 0  # of those, put back into the batch when another request came
    verify_passes: int = 0  # forward passes on the speculative path (plain steps included)
    drafted_tokens: int = 0  # draft tokens run through a verify pass
    accepted_tokens: int = 0  # of those, kept (the target agreed)
    tokens: int = 0  # tokens the speculative path produced
    seconds: float = 0.0  # time in its forward passes


class SoloToken(NamedTuple):
    """One token of a verify pass, shaped as mlx-lm's GenerationBatch.Response is read by the
    scheduler: the token, its logprobs row (from the target model) and why the request ends here."""

    token: int
    logprobs: mx.array
    finish_reason: str | None  # "stop" (eos), "length" (max_tokens) or None


class PromptLookup:
    """Drafts from the sequence itself: the tokens that followed the most recent earlier occurrence
    of its last n tokens (n from `max_ngram` down to `min_ngram`). The n-gram index grows with the
    sequence, so a proposal costs O(new tokens), not O(length)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.ngrams = range(max_ngram, min_ngram - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the position right after its latest occurrence
        self._indexed = 0  # n-grams ending at positions < this are in the index

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow `seq` (empty when no n-gram of its end occurred before)."""
        end = len(seq)
        for stop in range(max(self._indexed, 1), end):  # not the n-grams ending at `end`: that is the query
            for n in self.ngrams:
                if stop >= n:
                    self._index[tuple(seq[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in self.ngrams:
            at = self._index.get(tuple(seq[end - n :])) if end >= n else None
            if at is not None:
                return seq[at : at + k]
        return []


@dataclass
class AdaptiveDepth:
    """Chooses how many tokens to draft. Per request: the acceptance rate alpha (accepted draft
    tokens over accepted + rejected, decayed so it follows the text; it drifts back to the prior 1/2
    while nothing is drafted, so a request that stopped drafting tries again). Per engine: the cost
    of a pass w tokens wide (an average of measured passes; a width never measured is estimated from
    the one-token step, optimistically, so it gets measured once). A pass with k drafts yields
    (1 - alpha^(k+1)) / (1 - alpha) tokens on average; k = argmax of that over its cost, 0 unless it
    beats the one-token step by MARGIN."""

    max_depth: int
    costs: dict[int, float] = field(default_factory=dict)  # width -> seconds per pass

    def choose(self, accepted: float, rejected: float) -> int:
        one = self.costs.get(1)
        if one is None or self.max_depth <= 0:
            return 0  # measure a plain step first
        alpha = (accepted + 1.0) / (accepted + rejected + 2.0)
        best, best_rate = 0, 1.0 / one
        for k in range(1, self.max_depth + 1):
            expected = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
            rate = expected / self.cost(k + 1)
            if rate > best_rate * (1.0 + MARGIN if best == 0 else 1.0):
                best, best_rate = k, rate
        return best

    def cost(self, width: int) -> float:
        if width in self.costs:
            return self.costs[width]
        narrower = max(w for w in self.costs if w < width)
        return self.costs[narrower] * (1.0 + 0.02 * (width - narrower))

    def observe(self, width: int, seconds: float) -> None:
        old = self.costs.get(width)
        self.costs[width] = seconds if old is None else 0.8 * old + 0.2 * seconds


class SoloRun:
    """One request decoding alone: `cache` holds the KV of `seq[:-1]`; `seq[-1]` is the next input."""

    def __init__(self, key: Any, cache: list[Any], tokens: list[int], num_generated: int, max_tokens: int):
        self.key = key  # the scheduler's handle on the request
        self.cache = cache
        self.seq = list(tokens)
        self.num_generated = num_generated  # tokens sampled so far (eos included), as the batch counts them
        self.max_tokens = max_tokens
        self.drafter = PromptLookup()
        self.accepted = 0.0  # decayed counts behind the acceptance rate
        self.rejected = 0.0

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV `cache` holds."""
        return self.seq[:-1]


class Speculator:
    """The speculative path of one scheduler: which requests may take it, and their verify passes.
    One request at a time (`solo`). Raises only what the model's forward pass raises."""

    def __init__(self, model: Any, eos_ids: set[int], mode: str = "auto", max_draft_tokens: int = 8):
        if mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.model = model
        self.eos_ids = set(eos_ids)
        self.mode = mode
        self.depth = AdaptiveDepth(max_draft_tokens)
        self.stats = SpeculationStats()
        self.solo: SoloRun | None = None
        self.refused = ""  # why this model's layout cannot be rewound ("" = it can)

    def refuse_layout(self, layout: Any) -> None:
        """Turn speculation off for a cache layout that cannot be rewound (see the module docstring)."""
        if layout.has_state:
            self.refused = "recurrent layers: their state cannot be trimmed"
        elif layout.has_window:
            self.refused = "sliding-window layers: a rotated window cannot be trimmed"
        elif getattr(layout, "kv_bits", 0):
            self.refused = "cache.kv_bits: the batch's rounding cache does not survive extraction"

    def wants(self, params: SamplingParams) -> bool:
        """Whether a request with these settings may decode on the speculative path."""
        mode = params.speculative or self.mode
        return (
            not self.refused
            and mode in ("auto", "prompt_lookup")
            and self.depth.max_depth > 0
            and params.temperature == 0
            and not params.constrained
            and not params.logit_bias
            and not (params.presence_penalty or params.frequency_penalty)
        )

    def begin(self, key: Any, cache: list[Any], tokens: list[int], num_generated: int, max_tokens: int) -> None:
        """Take over a request whose `cache` holds the KV of `tokens` (prompt and output so far)."""
        if not all(c.is_trimmable() for c in cache):
            raise ValueError("speculation needs a trimmable cache")
        for c in cache:  # its last token is run again: its logits pick the next one
            c.trim(1)
        self.solo = SoloRun(key, cache, tokens, num_generated, max_tokens)
        self.stats.solo_requests += 1

    def end(self) -> SoloRun:
        """Give the request back (to the batch, or to be finished); its cache holds `kv_tokens`."""
        run, self.solo = self.solo, None
        assert run is not None
        return run

    def step(self) -> list[SoloToken]:
        """One verify pass for the solo request: its next tokens (at least one, at most k + 1),
        cut at eos and max_tokens; the cache then holds every token but the last."""
        run = self.solo
        assert run is not None
        room = run.max_tokens - run.num_generated
        k = min(self.depth.choose(run.accepted, run.rejected), room - 1)
        draft = run.drafter.propose(run.seq, k)
        width = 1 + len(draft)
        start = time.perf_counter()
        logits = self.model(mx.array([run.seq[-1], *draft])[None], cache=run.cache)[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picks = mx.argmax(logprobs, axis=-1)
        mx.eval(picks, logprobs)
        seconds = time.perf_counter() - start
        targets = picks.tolist()
        n = 0
        while n < len(draft) and targets[n] == draft[n]:
            n += 1
        out: list[SoloToken] = []
        for i, token in enumerate(targets[: n + 1]):
            run.num_generated += 1
            reason = "stop" if token in self.eos_ids else "length" if run.num_generated >= run.max_tokens else None
            out.append(SoloToken(token, logprobs[i], reason))
            if reason is not None:
                break
        for c in run.cache:  # keep the KV of the input and of the drafts that were accepted and used
            c.trim(width - len(out))
        run.seq.extend(t.token for t in out)
        self._account(run, width, len(draft), n, len(out), seconds)
        return out

    def _account(self, run: SoloRun, width: int, drafted: int, accepted: int, produced: int, seconds: float) -> None:
        self.depth.observe(width, seconds)
        run.accepted, run.rejected = 0.9 * run.accepted + accepted, 0.9 * run.rejected + (accepted < drafted)
        s = self.stats
        s.verify_passes += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.tokens += produced
        s.seconds += seconds

    def describe(self) -> dict[str, Any]:
        """For /health and /metrics: the mode, why it is off for this model, and the counters."""
        s = self.stats
        return {
            "mode": self.mode,
            "refused": self.refused,
            "max_draft_tokens": self.depth.max_depth,
            "solo_requests": s.solo_requests,
            "rejoins": s.rejoins,
            "verify_passes": s.verify_passes,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": round(s.accepted_tokens / s.drafted_tokens, 3) if s.drafted_tokens else 0.0,
            "tokens_per_pass": round(s.tokens / s.verify_passes, 2) if s.verify_passes else 0.0,
        }


def build_speculator(model: Any, tokenizer: Any, layout: Any, mode: str, max_draft_tokens: int) -> Speculator:
    """The scheduler's speculative path for this model ([speculative] mode and max_draft_tokens);
    built with mode "off" too, so a request may still ask for it (kvserve.speculative)."""
    spec = Speculator(model, set(tokenizer.eos_token_ids), mode, max_draft_tokens)
    spec.refuse_layout(layout)
    return spec
