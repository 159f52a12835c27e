"""The scheduler's speculative path (engine/speculative/speculator.py): a request alone in the batch leaves
mlx-lm's batch and decodes by drafts (prompt lookup or a draft model) verified k at a time on its
own cache; it goes back into the batch as soon as another request is admitted. Functions of the Scheduler
(they drive its batch and its per-token path), kept apart so scheduler.py stays one job."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..speculative.acceptance import resumed_sampler
from .state import Running

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)


def speculate(self: Scheduler) -> bool:
    """Decode a request that runs alone on the speculative path: one verify pass, True when it
    ran (the batch does not step). A request alone in the batch, its first token out,
    leaves the batch for it; it goes back as soon as another request is admitted."""
    spec = self.speculation
    assert spec is not None
    alone = len(self._running) == 1 and not self._waiting and not self._pending
    if spec.solo is None:
        run = next(iter(self._running.values())) if alone else None
        if run is None or not (run.prompt_registered and run.generated and spec.wants(run.req.params)):
            return False
        cache, tokens = self._generator().remove([run.uid], return_prompt_caches=True)[run.uid]
        params, prompt_len = run.req.params, len(run.req.prompt_tokens)
        root = run.req.cache_root  # the draft's block cache is salted per principal too
        self._guard(run, spec.begin, run, cache, list(tokens), len(run.generated), params, prompt_len, root)
        if spec.solo is None:  # it failed
            return True
    else:
        run = spec.solo.key
        if not alone:
            self._guard(run, rejoin, self, run)
            return False
    if run.req.cancelled.is_set():
        self._guard(run, self._end, run, "cancelled")
    elif spec.solo is not None:
        start = time.perf_counter()
        try:
            tokens = spec.step()
        except Exception as exc:
            log.exception("request %s failed on the speculative path", run.req.request_id)
            tokens = []
            self._drop(run, exc)
        self.stats.decode_tokens += len(tokens)
        self.stats.decode_s += time.perf_counter() - start
        for token in tokens:
            if self._running.get(run.uid) is not run:
                break
            self._guard(run, self._on_token, run, token)
    if spec.solo is not None and self._running.get(run.uid) is not run:  # it failed
        spec.end(failed=True)
    return True


def rejoin(self: Scheduler, run: Running) -> None:
    """Put the request decoding alone back into the batch, where its last token goes next (a
    seeded sampler resumes its key chain at the next position)."""
    assert self.speculation is not None
    solo = self.speculation.end()
    self.speculation.stats.rejoins += 1
    params = run.req.params
    (uid,) = self._generator().insert_segments(
        [[solo.seq[-1:]]],
        max_tokens=[params.max_tokens - solo.num_generated],
        samplers=[run.fault.sampler(resumed_sampler(params, solo.num_generated))],
        logits_processors=[[run.fault.processor(solo.grammar.processor())]] if solo.grammar is not None else None,
        caches=[solo.cache],
        all_tokens=[solo.kv_tokens],
        stop_sequences=[self._eos],
    )
    del self._running[run.uid]
    run.uid = uid
    self._running[uid] = run
