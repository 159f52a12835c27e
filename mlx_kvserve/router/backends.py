"""What the router knows about each backend: its load (counted by the router as it proxies) and its blocks.

Load counters change when a request starts and finishes, never inside a picker (seed 004). The block set
mirrors the backend's block events; `estimate_cache_hit` is the longest prefix of the request's chained
block hashes that the backend reported stored, in tokens.

A claim is checked against what the backend then reports: a routed reply whose cached_tokens fall clearly
short of the blocks the router counted on (`contradicts`) is a strike; CLAIM_STRIKES in a row and the
backend's blocks estimate no hit for CLAIM_PENALTY_S (a backend claiming blocks it does not have would
otherwise draw every request for them). One short reply alone is not enough: an eviction may race the
request past the block events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from .models import LOADED, ModelReport, is_default
from .policies import BackendView

CLAIM_STRIKES = 3  # contradicted replies in a row before the claims are ignored
CLAIM_PENALTY_S = 60.0  # how long they are ignored then


def is_weighable(claimed_tokens: int, block_size: int) -> bool:
    """A claim a reply can contradict: at least two blocks (a server recomputes a prompt's last token, so a
    one-block claim can honestly come back as 0; no claim says nothing)."""
    return claimed_tokens >= 2 * block_size > 0


def contradicts(claimed_tokens: int, reported_tokens: int) -> bool:
    """A reply's reported cached tokens clearly short of the claimed hit: under half of it."""
    return 2 * reported_tokens < claimed_tokens


class BackendState:
    """One backend. All fields are guarded by `_lock`; the router and the event follower share it.

    It is in rotation (`is_up`) while it is reachable (its /health and the requests sent to it succeed) and
    what it reports (layout, block events) is usable: the two are tracked apart, since a backend that answers
    its health checks may still report a layout the router cannot hash with."""

    def __init__(self, url: str, block_size: int = 0, clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.clock = clock
        self.block_size = block_size  # 0 until the backend's layout is known: no hit can be estimated
        self.namespace: bytes | None = None  # the backend's hashing namespace, from its layout
        self._lock = threading.Lock()
        self._blocks: set[bytes] = set()
        self.is_reachable = True
        self.last_error = ""  # why it was last found unreachable ("" while reachable)
        self.report_error = ""  # why its last report was unusable ("" while its reports are sound)
        self.num_requests = 0
        self.pending_prefill_tokens = 0
        self.decode_tokens = 0
        self._models: ModelReport | None = None  # what its /health reports it serves (None: not yet)
        self.num_contradictions = 0  # routed replies that contradicted the claimed blocks, ever
        self._strikes = 0  # contradictions in a row; a reply that agrees resets it
        self._ignore_claims_until = 0.0  # clock(); before it, the blocks estimate no hit

    # --- layout and health --------------------------------------------------------------------------------

    @property
    def is_up(self) -> bool:
        """In rotation: reachable, and reporting what the router can use."""
        with self._lock:
            return self.is_reachable and not self.report_error

    @property
    def error(self) -> str:
        """Why it is out of rotation ("" while up)."""
        with self._lock:
            return self.last_error or self.report_error

    def set_layout(self, namespace: bytes | None, block_size: int) -> None:
        """The backend's hashing (checked by reports.parse_layout: a namespace comes with a block size >= 1);
        a changed namespace (another model, block size) forgets the old blocks."""
        assert (namespace is None) == (block_size == 0) and block_size >= 0, "an unchecked layout"
        with self._lock:
            if namespace != self.namespace or block_size != self.block_size:
                self._blocks = set()
            self.namespace, self.block_size = namespace, block_size

    def mark_down(self, reason: str) -> None:
        with self._lock:
            self.is_reachable, self.last_error = False, reason

    def mark_up(self) -> None:
        with self._lock:
            self.is_reachable, self.last_error = True, ""

    def mark_bad_report(self, reason: str) -> None:
        """Out of rotation until `mark_sound_report`; the blocks it reported are forgotten (the follower
        takes a fresh snapshot when the backend reports sound data again)."""
        with self._lock:
            self.report_error, self._blocks = reason, set()

    def mark_sound_report(self) -> None:
        with self._lock:
            self.report_error = ""

    # --- models -------------------------------------------------------------------------------------------

    @property
    def models(self) -> ModelReport | None:
        with self._lock:
            return self._models

    def set_models(self, report: ModelReport | None) -> None:
        """What the backend's last /health said it serves; None (it said nothing usable) keeps the last."""
        if report is not None:
            with self._lock:
                self._models = report

    def note_loaded(self, model: str | None) -> None:
        """The backend answered a request naming `model`: it has it loaded now (until its next report)."""
        with self._lock:
            found = self._models.ids.get(model) if self._models is not None and not is_default(model) else None
            if found is not None:
                self._models.states[found] = LOADED

    # --- blocks -------------------------------------------------------------------------------------------

    def apply_events(self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = ()) -> None:
        with self._lock:
            self._blocks.update(stored)
            self._blocks.difference_update(removed)

    def apply_ordered(self, events: Iterable[tuple[bool, bytes]]) -> None:
        """(is_stored, hash) pairs in the order the backend's RAM changed: a hash stored then removed is gone."""
        with self._lock:
            for is_stored, block_hash in events:
                if is_stored:
                    self._blocks.add(block_hash)
                else:
                    self._blocks.discard(block_hash)

    def reset_blocks(self, snapshot: Iterable[bytes]) -> None:
        """Replace the block set with a snapshot (after a reconnect or a resync)."""
        with self._lock:
            self._blocks = set(snapshot)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._blocks)

    def estimate_cache_hit(self, block_hashes: Sequence[bytes]) -> int:
        """Tokens of the longest prefix of `block_hashes` this backend holds (chained, so stop at the first
        miss); 0 while its claims are ignored."""
        with self._lock:
            if self.clock() < self._ignore_claims_until:
                return 0
            n = 0
            for h in block_hashes:
                if h not in self._blocks:
                    break
                n += 1
            return n * self.block_size

    def check_claim(self, claimed_tokens: int, reported_tokens: int) -> bool:
        """Weigh a routed reply's reported cached tokens against the hit its blocks claimed. Returns True when
        this reply made the claims ignored (CLAIM_STRIKES contradictions in a row)."""
        with self._lock:
            if not is_weighable(claimed_tokens, self.block_size):  # e.g. while its claims are ignored
                return False
            if not contradicts(claimed_tokens, reported_tokens):
                self._strikes = 0
                return False
            self.num_contradictions += 1
            self._strikes += 1
            if self._strikes < CLAIM_STRIKES:
                return False
            # Still at the threshold when the penalty ends: the next contradiction starts another at once.
            self._strikes = CLAIM_STRIKES - 1
            self._ignore_claims_until = self.clock() + CLAIM_PENALTY_S
            return True

    @property
    def claims_ignored_s(self) -> float:
        """Seconds left until its claims count again (0: they count)."""
        with self._lock:
            return max(0.0, self._ignore_claims_until - self.clock())

    # --- load ---------------------------------------------------------------------------------------------

    def start_request(self, prefill_tokens: int) -> None:
        with self._lock:
            self.num_requests += 1
            self.pending_prefill_tokens += prefill_tokens

    def prefill_done(self, prefill_tokens: int) -> None:
        """The first token arrived: the prefill estimate is no longer pending."""
        with self._lock:
            self.pending_prefill_tokens = max(0, self.pending_prefill_tokens - prefill_tokens)

    def decoded(self, num_tokens: int = 1) -> None:
        with self._lock:
            self.decode_tokens += num_tokens

    def finish_request(self, pending_prefill_left: int, decoded_tokens: int) -> None:
        """Undo `start_request` and the decode tokens counted for it; clamps at zero."""
        with self._lock:
            self.num_requests = max(0, self.num_requests - 1)
            self.pending_prefill_tokens = max(0, self.pending_prefill_tokens - pending_prefill_left)
            self.decode_tokens = max(0, self.decode_tokens - decoded_tokens)

    def view(self, block_hashes: Sequence[bytes]) -> BackendView:
        """The picker's snapshot of this backend for one request."""
        hit = self.estimate_cache_hit(block_hashes)
        with self._lock:
            return BackendView(self.url, self.num_requests, self.pending_prefill_tokens, self.decode_tokens, hit)
