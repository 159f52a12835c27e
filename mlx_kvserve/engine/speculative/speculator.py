"""Speculative decoding for a request that decodes alone, on the worker thread.

mlx-lm's BatchGenerator steps every row by one token, so it cannot verify k drafted tokens per row.
While one request runs alone (nothing else in the batch, waiting or pending: the local single-user
case, where decode is the bottleneck) the scheduler takes its KV out of the batch and hands it to
`Speculator`, which decodes it on its plain per-request cache: draft k tokens, either from the
n-grams of prompt + output (`PromptLookup`: their most frequent continuations, llama.cpp's rule) or
with a small draft model of the same tokenizer (engine/speculative/draft.py), run the last token and the
k drafts through the model in one forward pass, keep the longest prefix the request's sampler
accepts (engine/speculative/acceptance.py: greedy, or the speculative-sampling rule), then trim the cache's
rejected positions. When another request arrives the scheduler puts the request back into the
batch (`rejoin`).

Greedy and sampled requests alike; constrained ones (json_schema / tool grammar) have their drafts
checked against the grammar (engine/speculative/grammar.py). Penalised or logit_bias requests stay on the
batch path; so do layouts whose cache cannot be rewound: recurrent layers (no checkpoint per
position), sliding windows (a rotated window cannot be trimmed) and rounded KV (cache.kv_bits).

`AdaptiveDepth` picks k per verify pass (0 = a plain one-token step): the expected tokens a pass
yields, from the request's acceptance rate, over the measured cost of a pass that wide (drafting
included), against the measured cost of a one-token step; one table per kind of drafter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx

from ..request import SamplingParams
from ..sampling.constrain import grammars_for
from .acceptance import Acceptance
from .draft import DraftModel, DraftRun
from .grammar import DraftGrammar

MODES = ("auto", "off", "prompt_lookup", "draft")
PROMPT_LOOKUP, DRAFT = "prompt_lookup", "draft"
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
    draft_cached_tokens: int = 0  # prompt tokens the draft model found in its block cache when a request went solo
    draft_prefill_tokens: int = 0  # tokens the draft model prefilled then


class SoloToken(NamedTuple):
    """One token of a verify pass, shaped as mlx-lm's GenerationBatch.Response is read by the
    scheduler: the token, its logprobs row (from the target model) and why the request ends here."""

    token: int
    logprobs: mx.array
    finish_reason: str | None  # "stop" (eos), "length" (max_tokens) or None


class Followers:
    """The tokens seen right after one n-gram: counts, their sum, and the most frequent one (ties:
    the one seen last, kept as counts grow so a lookup costs O(1))."""

    __slots__ = ("counts", "total", "best", "best_count")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0
        self.best, self.best_count = -1, 0

    def add(self, token: int) -> None:
        count = self.counts[token] = self.counts.get(token, 0) + 1
        self.total += 1
        if count >= self.best_count:
            self.best, self.best_count = token, count


class PromptLookup:
    """Drafts from the sequence itself, as llama.cpp's lookup decoding does with its context cache
    (common/ngram-cache.cpp): for each n-gram of prompt + output (n from `min_ngram` to `max_ngram`)
    the counts of the tokens that followed it. A draft grows one token at a time: the most frequent
    follower of the longest n-gram the sequence (drafts included) ends with that was seen at least
    MIN_SAMPLES[n] times and whose top follower took at least MIN_SHARE[n] of them (a shorter n-gram
    is tried when one falls short); the draft stops where none qualifies. So a draft runs past the end
    of any one earlier occurrence, and an n-gram whose continuations disagree drafts nothing rather
    than the latest of them. The index grows with the sequence: a proposal costs O(new tokens + k)."""

    # llama.cpp's draft_min_sample_size_lax / draft_min_percent_lax, for n = 1, 2, 3, 4 (and above)
    MIN_SAMPLES = (2, 2, 1, 1)
    MIN_SHARE = (0.66, 0.5, 0.5, 0.5)

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.ngrams = range(max_ngram, min_ngram - 1, -1)
        self._index: dict[tuple[int, ...], Followers] = {}
        self._indexed = 0  # the followers at positions < this are counted

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow `seq` (empty when no n-gram of its end qualifies)."""
        for at in range(max(self._indexed, 1), len(seq)):  # seq[at] follows the n-grams ending there
            for n in self.ngrams:
                if at >= n:
                    self._index.setdefault(tuple(seq[at - n : at]), Followers()).add(seq[at])
        self._indexed = max(self._indexed, len(seq))
        draft: list[int] = []
        while len(draft) < k:
            token = self._next(seq, draft)
            if token is None:
                break
            draft.append(token)
        return draft

    def _next(self, seq: list[int], draft: list[int]) -> int | None:
        """The next draft token after seq + draft, or None."""
        end = seq[-self.ngrams[0] :] + draft
        for n in self.ngrams:
            found = self._index.get(tuple(end[-n:])) if len(end) >= n else None
            i = min(n, len(self.MIN_SAMPLES)) - 1
            if (
                found is not None
                and found.total >= self.MIN_SAMPLES[i]
                and found.best_count >= self.MIN_SHARE[i] * found.total
            ):
                return found.best
        return None


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
    """One request decoding alone: `cache` holds the KV of `seq[:-1]`; `seq[-1]` is the next input.
    `drafter`: its PromptLookup, or its draft model's run (`kind` says which)."""

    def __init__(
        self,
        key: Any,
        cache: list[Any],
        tokens: list[int],
        num_generated: int,
        max_tokens: int,
        params: SamplingParams,
        drafter: PromptLookup | DraftRun,
    ):
        self.key = key  # the scheduler's handle on the request
        self.cache = cache
        self.seq = list(tokens)
        self.num_generated = num_generated  # tokens sampled so far (eos included), as the batch counts them
        self.max_tokens = max_tokens
        self.drafter = drafter
        self.kind = DRAFT if isinstance(drafter, DraftRun) else PROMPT_LOOKUP
        self.acceptance = Acceptance(params, num_generated)
        self.grammar: DraftGrammar | None = None  # a constrained request's matcher
        self.accepted = 0.0  # decayed counts behind the acceptance rate
        self.rejected = 0.0

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV `cache` holds."""
        return self.seq[:-1]

    def propose(self, k: int) -> tuple[mx.array, list[int] | None]:
        """Up to k drafts: (tokens to feed, as an array, lazily for a draft model; the list when known)."""
        if isinstance(self.drafter, DraftRun):
            return self.drafter.propose(self.seq, k, self.acceptance), None
        draft = self.drafter.propose(self.seq, k)
        return mx.array(draft, mx.uint32), draft


class Speculator:
    """The speculative path of one scheduler: which requests may take it, and their verify passes.
    One request at a time (`solo`). Raises only what the models' forward passes raise."""

    def __init__(
        self,
        model: Any,
        eos_ids: set[int],
        mode: str = "auto",
        max_draft_tokens: int = 8,
        draft: DraftModel | None = None,
        tokenizer: Any = None,
    ):
        if mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.model = model
        self.eos_ids = set(eos_ids)
        self.mode = mode
        self.draft = draft
        self.tokenizer = tokenizer  # for constrained requests' grammars (None: they stay on the batch path)
        # Pass costs per kind of drafter: a draft model's passes include its k draft steps.
        self.depths = {PROMPT_LOOKUP: AdaptiveDepth(max_draft_tokens), DRAFT: AdaptiveDepth(max_draft_tokens)}
        self.stats = SpeculationStats()
        self.solo: SoloRun | None = None
        self.refused = ""  # why this model's layout cannot be rewound ("" = it can)

    @property
    def depth(self) -> AdaptiveDepth:
        """The prompt-lookup depth (the draft model's: depths[DRAFT])."""
        return self.depths[PROMPT_LOOKUP]

    def refuse_layout(self, layout: Any) -> None:
        """Turn speculation off for a cache layout that cannot be rewound (see the module docstring)."""
        if layout.has_state:
            self.refused = "recurrent layers: their state cannot be trimmed"
        elif layout.has_window:
            self.refused = "sliding-window layers: a rotated window cannot be trimmed"
        elif getattr(layout, "kv_bits", 0):
            self.refused = "cache.kv_bits: the batch's rounding cache does not survive extraction"

    def kind(self, params: SamplingParams) -> str:
        """The drafter a request with these settings gets: DRAFT, PROMPT_LOOKUP or "" (none):
        "auto" takes the draft model when one is loaded; "draft" without one decodes plainly."""
        mode = params.speculative or self.mode
        if mode == DRAFT or (mode == "auto" and self.draft is not None):
            return DRAFT if self.draft is not None else ""
        return PROMPT_LOOKUP if mode in ("auto", PROMPT_LOOKUP) else ""

    def wants(self, params: SamplingParams) -> bool:
        """Whether a request with these settings may decode on the speculative path."""
        return (
            not self.refused
            and bool(self.kind(params))
            and self.depth.max_depth > 0
            and (self.tokenizer is not None or not params.constrained)
            and not params.logit_bias
            and not (params.presence_penalty or params.frequency_penalty)
        )

    def begin(
        self,
        key: Any,
        cache: list[Any],
        tokens: list[int],
        num_generated: int,
        params: SamplingParams,
        prompt_len: int,
        root: bytes | None = None,
    ) -> None:
        """Take over a request whose `cache` holds the KV of `tokens` (prompt and output so far;
        `prompt_len` of them the prompt). Its draft model, if it gets one, prefills here, its block
        cache walked from the request's principal's `root` (kv/salts.py)."""
        if not all(c.is_trimmable() for c in cache):
            raise ValueError("speculation needs a trimmable cache")
        drafter: PromptLookup | DraftRun = PromptLookup()
        if self.kind(params) == DRAFT:
            assert self.draft is not None
            drafter = self.draft.open(tokens[:prompt_len], tokens, root)
            self.stats.draft_cached_tokens += drafter.cached_tokens
            self.stats.draft_prefill_tokens += len(drafter.fed) - drafter.cached_tokens
        for c in cache:  # its last token is run again: its logits pick the next one
            c.trim(1)
        solo = SoloRun(key, cache, tokens, num_generated, params.max_tokens, params, drafter)
        if params.constrained:
            grammars = grammars_for(self.tokenizer)
            solo.grammar = DraftGrammar(
                grammars, grammars.matcher(params.json_schema, params.grammar), tokens[prompt_len:]
            )
        self.solo = solo
        self.stats.solo_requests += 1

    def end(self, failed: bool = False) -> SoloRun:
        """Give the request back (to the batch, or to be finished); its cache holds `kv_tokens`.
        Its draft model's blocks are registered (unless it `failed`)."""
        run, self.solo = self.solo, None
        assert run is not None
        if isinstance(run.drafter, DraftRun):
            run.drafter.close(keep=not failed)
        return run

    def step(self) -> list[SoloToken]:
        """One verify pass for the solo request: its next tokens (at least one, at most k + 1),
        cut at eos and max_tokens; the cache then holds every token but the last."""
        run = self.solo
        assert run is not None
        depth = self.depths[run.kind]
        room = run.max_tokens - run.num_generated
        k = min(depth.choose(run.accepted, run.rejected), room - 1)
        start = time.perf_counter()
        inputs, draft = run.propose(k)
        proposed = draft
        if run.grammar is not None:  # the masks depend on the drafts: know them before the pass
            proposed = draft = inputs.tolist() if draft is None else draft
            draft = run.grammar.check(draft)
            inputs = inputs[: len(draft)]
        logits = self.model(mx.concatenate([mx.array(run.seq[-1:], mx.uint32), inputs])[None], cache=run.cache)[0]
        if run.grammar is not None:
            logits = mx.where(run.grammar.masks(logits.shape[-1]), logits, -mx.inf)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs, inputs)
        if draft is None:
            proposed = draft = inputs.tolist()
        verdict = run.acceptance.verify(logprobs, draft)
        seconds = time.perf_counter() - start
        width = 1 + len(draft)
        out: list[SoloToken] = []
        for i, token in enumerate(verdict.tokens):
            run.num_generated += 1
            reason = "stop" if token in self.eos_ids else "length" if run.num_generated >= run.max_tokens else None
            out.append(SoloToken(token, logprobs[i], reason))
            if reason is not None:
                break
        for c in run.cache:  # keep the KV of the input and of the drafts that were accepted and used
            c.trim(width - len(out))
        run.seq.extend(t.token for t in out)
        run.acceptance.advance(len(out))
        if run.grammar is not None:
            run.grammar.commit([t.token for t in out])
        if isinstance(run.drafter, DraftRun):
            run.drafter.settle(proposed, run.seq)
        self._account(run, width, len(draft), verdict.accepted, len(out), seconds)
        return out

    def _account(self, run: SoloRun, width: int, drafted: int, accepted: int, produced: int, seconds: float) -> None:
        self.depths[run.kind].observe(width, seconds)
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
            "draft_model": self.draft.name if self.draft is not None else "",
            "refused": self.refused,
            "max_draft_tokens": self.depth.max_depth,
            "solo_requests": s.solo_requests,
            "rejoins": s.rejoins,
            "verify_passes": s.verify_passes,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": round(s.accepted_tokens / s.drafted_tokens, 3) if s.drafted_tokens else 0.0,
            "tokens_per_pass": round(s.tokens / s.verify_passes, 2) if s.verify_passes else 0.0,
            "draft_cached_tokens": s.draft_cached_tokens,
            "draft_prefill_tokens": s.draft_prefill_tokens,
        }


def build_speculator(
    model: Any, tokenizer: Any, layout: Any, mode: str, max_draft_tokens: int, draft: DraftModel | None = None
) -> Speculator:
    """The scheduler's speculative path for this model ([speculative] mode, max_draft_tokens and
    the loaded draft_model); built with mode "off" too, so a request may still ask for it
    (kvserve.speculative)."""
    spec = Speculator(model, set(tokenizer.eos_token_ids), mode, max_draft_tokens, draft, tokenizer)
    spec.refuse_layout(layout)
    return spec
