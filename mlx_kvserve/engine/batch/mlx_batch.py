"""mlx-lm's BatchGenerator with a request's first token one batch step sooner.

mlx-lm's step (`BatchGenerator._next`) runs the decode batch first, then moves the requests whose
prompt is done (all but its last token prefilled) to the decode batch, then prefills the next chunk
of the others. A request whose last chunk was prefilled in step k therefore moves in step k+1 after
that step's decode, and gets its first token in step k+2: one whole batch step (a decode pass of
everyone running) after it could. Here each step first moves the requests that were done before it,
so they decode in that same step: their first token comes in step k+1, in the decode pass the others
run anyway. Everything else is mlx-lm's step as it is (the move below is its own code, run earlier;
a request whose prompt is done within the step still moves where mlx-lm moves it). The first tokens
of the requests it moves are known once the move's one-token pass ran: `on_first_tokens` hands them
to the scheduler then, which sends them before the decode pass that reports them.

A step that moved requests, or that a request joined directly (`insert_decoding`), ends after the
decode pass: mlx-lm's step would go on to prefill the next chunk of the prompts still prefilling (a
whole chunk: seconds on the CPU) before returning, and their first tokens would wait for it. Those
prompts prefill one decode pass later instead.

With `share_step` (the default; `generation.prefill_step_shared`), the prompts prefilling together share
one step's `prefill_step_size` tokens (each its part, at least MIN_SHARE), as vLLM's per-step token budget
does: in mlx-lm's step each prompt prefills a whole chunk, so n cold prompts make a step n chunks long
(8 on the CPU: ~40 s), and every running request's next token and every later turn waits for all of it.

mlx-lm's private members the engine relies on (why pyproject.toml pins mlx-lm to its tested minor, 0.32;
check each of these when moving to a new mlx-lm):
- `mlx_lm.generate` here: `BatchGenerator._next` (overridden), `._prompt_batch`, `._generation_batch`,
  `._currently_processing`, `._unprocessed_sequences`, `._make_batch`, `._find_uids`, `._uid_count`,
  `._counters`; `GenerationBatch._next_tokens`, `._next_logprobs`, `._token_context`, `._num_tokens`,
  `._matchers`, and that its `next` takes an ending row's cache with `self.extract_cache(i)`; the function
  `_merge_caches`.
- `mlx_lm.models.cache.RotatingKVCache._idx` and `._temporal_order` (kv/blocks.py).
- `mlx_lm.tokenizer_utils.TokenizerWrapper._tokenizer`, the Hugging Face tokenizer inside (engine/sampling/constrain.py,
  engine/sampling/tool_grammar.py, engine/cache/message_starts.py; read with getattr and a fallback).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, TokenBuffer, _merge_caches

from ...kv.blocks import borrowed_row
from ..memory.device import rewire

MIN_SHARE = 32  # prompt tokens per prompt and step, however many prefill together


class KVServeBatchGenerator(BatchGenerator):
    share_step = True
    # Called with (uids, first tokens, their log-probability rows) of the requests this step moved to
    # decoding, before the decode pass that reports those tokens (the scheduler sends them at once).
    on_first_tokens: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rewire()  # mlx-lm wired the recommended working set: the memory plan's limit instead
        self._joining: list[tuple] = []  # requests inserted by insert_decoding, entering at the next step
        # A request ending in the decode pass leaves with views of its row (`_ended_row`), not mlx-lm's
        # `extract`: a contiguous copy of its whole KV, a second copy of the prefix at the hit's peak.
        self._generation_batch.extract_cache = self._ended_row
        # (tokens done, tokens to prefill) of each prompt still prefilling after the last step, for
        # /health and /ui; replaced whole by the worker thread, so a reader never sees it half built.
        self.prefill_progress: dict[int, tuple[int, int]] = {}  # by uid

    def _next(self) -> tuple[list[Any], list[Any]]:
        joined = self._enter_joining()
        moved = self._move_done_prompts()
        if (moved or joined) and (self._currently_processing or self._unprocessed_sequences):
            return moved, self._decode_only()
        step = self.prefill_step_size
        if self.share_step and len(self._currently_processing) > 1:
            # mlx-lm cuts each prompt's chunk by this attribute in its step; the prompt batch
            # keeps whole passes (its own attribute) so that a chunk is never split again.
            self._prompt_batch.prefill_step_size = step
            self.prefill_step_size = max(MIN_SHARE, step // len(self._currently_processing))
        try:
            prompt_responses, generation_responses = super()._next()
        finally:
            self.prefill_step_size = step
        self.prefill_progress = {r.uid: tuple(r.progress) for r in prompt_responses if not r.end_of_prompt}
        return moved + prompt_responses, generation_responses

    def insert_decoding(
        self,
        cache: list[Any],
        tokens: list[int],
        first: mx.array,
        logprobs: mx.array,
        max_tokens: int,
        sampler: Any,
        processors: list[Any],
        stop_sequences: Any,
    ) -> int:
        """Put a request straight into the decode batch: `cache` holds the KV of all its `tokens`
        (the whole prompt) and `first` (with `logprobs`, [1, V]) was sampled from their last logits
        (engine/batch/direct_join.py). The next decode pass reports `first` and computes the token after
        it, as for a request the batch moved there itself. The requests joining before a step enter
        together at its start (one merge of their caches, one extend of the batch's). Returns its uid."""
        uid = self._uid_count
        self._uid_count += 1
        self._joining.append(
            (uid, cache, list(tokens), first, logprobs, max_tokens, sampler, processors, stop_sequences)
        )
        return uid

    def _enter_joining(self) -> bool:
        """Extend the decode batch with the requests inserted by `insert_decoding` since the last
        step: mlx-lm's GenerationBatch fields set as its __init__ and _step would have, the first
        token as the next input. Whether any entered."""
        if not self._joining:
            return False
        uids, caches, tokens, firsts, logprobs, max_tokens, samplers, processors, stops = zip(
            *self._joining, strict=True
        )
        self._joining = []
        joining = GenerationBatch.empty(self.model, self.sampler)
        joining.uids = list(uids)
        joining.prompt_cache = _merge_caches(list(caches))  # alone: no copy (kv/cache_fill.py merge_alone)
        joining.tokens = list(tokens)
        joining.samplers = list(samplers)
        joining.logits_processors = list(processors)
        joining.stop_sequences = list(stops)
        joining.max_tokens = list(max_tokens)
        joining._next_tokens = mx.concatenate(firsts)
        joining._next_logprobs = [lp[0] for lp in logprobs]
        joining._token_context = [TokenBuffer(t) for t in tokens]
        joining._num_tokens = [0] * len(uids)
        joining._matchers = [stop.matcher() for stop in stops]
        self._generation_batch.extend(joining)
        return True

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        """mlx-lm's, a decoding request's cache borrowed (`extract_cache`): a lone row without
        padding takes the batch's arrays themselves, which the batch lets go."""
        self._enter_joining()
        caches = self._borrow(uids, whole=True) if return_prompt_caches else {}
        super().remove(uids)
        return caches

    def extract_cache(self, uids: Any) -> Any:
        """mlx-lm's, but a decoding request's full-attention layers are views of the batch's arrays
        (kv/blocks.py `borrowed_row`), not a copy of its whole KV: the caller cuts its new blocks
        from them and drops them before the batch's next step (whose writes would copy the arrays)."""
        self._enter_joining()
        return self._borrow(uids, whole=False)

    def _ended_row(self, idx: int) -> list[Any]:
        """The cache of the decode batch's row `idx`, which ends in this pass: views of the batch's
        arrays (kv/blocks.py `borrowed_row`). The batch filters the row out right after (into new
        arrays), so nothing writes the viewed ones; the caller cuts its blocks from them and drops them."""
        return [borrowed_row(c, idx) for c in self._generation_batch.prompt_cache]

    def _borrow(self, uids: Any, whole: bool) -> dict[int, tuple[list[Any], Any]]:
        out = {}
        for uid, (stage, idx) in self._find_uids(uids).items():
            if stage == 2:
                batch = self._generation_batch
                out[uid] = ([borrowed_row(c, idx, whole) for c in batch.prompt_cache], batch.tokens[idx])
            else:
                out.update(super().extract_cache([uid]))
        return out

    def _decode_only(self) -> list[Any]:
        """The decode pass of mlx-lm's step (`BatchGenerator._next`'s first part, with its counters)."""
        start = time.perf_counter()
        responses = self._generation_batch.next()
        self._counters.decode_time += time.perf_counter() - start
        self._counters.generation_tokens += len(responses)
        self._counters.generation_steps += 1
        return responses

    def _move_done_prompts(self) -> list[Any]:
        """Move the requests with only their last token left to the decode batch (mlx-lm's split:
        their cache leaves the prompt batch, the last token becomes their first decode input);
        returns their end-of-prompt responses. Waiting sequences enter the prompt batch first (mlx-lm's
        own extend, run earlier), so one inserted with only its last token left (its rest prefilled
        on its own: engine/batch/side_prefill.py) decodes in this step."""
        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(self._generation_batch),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))
        done = [i for i, seq in enumerate(self._currently_processing) if len(seq[0]) == 1 and len(seq[0][0]) == 1]
        if not done:
            return []
        last_inputs = [self._currently_processing[i][0][0] for i in done]
        progress = [(self._currently_processing[i][2],) * 2 for i in done]
        self._currently_processing = [s for i, s in enumerate(self._currently_processing) if i not in set(done)]
        gen_batch = self._prompt_batch.split(done).generate(last_inputs)
        if self.on_first_tokens is not None:  # sampled by the move's one-token pass: known now
            mx.eval(gen_batch._next_tokens, gen_batch._next_logprobs)
            self.on_first_tokens(list(gen_batch.uids), gen_batch._next_tokens.tolist(), gen_batch._next_logprobs)
        self._generation_batch.extend(gen_batch)
        return [
            PromptProcessingBatch.Response(uid, p, True, True) for uid, p in zip(gen_batch.uids, progress, strict=True)
        ]
