"""Grammar-checked drafts: a constrained request (response_format json_schema, tool-call grammar) on
the speculative path (engine/speculative/speculator.py).

The batch masks each row's logits with the request's llguidance matcher (engine/sampling/constrain.py)
before sampling. A verify pass needs that mask at every drafted position, and each mask depends on
the drafts before it: the matcher checks how many drafts the grammar allows (`validate_tokens`),
consumes them one by one to fill one mask row per position, then rolls them back (`rollback`); once
the pass has decided, the emitted tokens are consumed for good. Drafts past the first one the
grammar refuses are dropped; that one is kept: the target, masked, never picks it, so it is
rejected (for the speculative-sampling rule too, where dropping it would bias the draw). Rows
after it are never reached (they repeat its mask: a row with nothing allowed would be NaN).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


class DraftGrammar:
    """One request's matcher, following the tokens it emitted (`generated` at the start)."""

    def __init__(self, grammars: Any, matcher: Any, generated: list[int]):
        import llguidance.numpy

        self.grammars = grammars  # constrain.Grammars: builds the batch's processor at rejoin
        self.matcher = matcher
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._allocate = llguidance.numpy.allocate_token_bitmask
        self.vocab_size = grammars.vocab_size
        matcher.consume_tokens(list(generated))
        self._valid, self._kept = 0, []  # set by check, read by masks

    def check(self, draft: list[int]) -> list[int]:
        """The drafts to verify: up to and including the first one the grammar refuses."""
        self._valid = self.matcher.validate_tokens(list(draft))
        self._kept = list(draft[: self._valid + 1])
        return self._kept

    def masks(self, width: int) -> mx.array:
        """What the grammar allows at each position of the pass over the drafts `check` kept:
        [len(kept) + 1, width] booleans."""
        valid, kept = self._valid, self._kept
        bits = self._allocate(valid + 1, self.vocab_size)
        self._fill(self.matcher, bits, 0)
        for i in range(valid):
            self.matcher.consume_token(kept[i])
            self._fill(self.matcher, bits, i + 1)
        if valid:
            self.matcher.rollback(valid)
        allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, : self.vocab_size].astype(bool)
        rows = np.zeros((len(kept) + 1, width), dtype=bool)
        rows[: valid + 1, : min(width, self.vocab_size)] = allowed[:, :width]
        rows[valid + 1 :] = rows[valid]
        return mx.array(rows)

    def commit(self, tokens: list[int]) -> None:
        """The tokens the pass emitted (each allowed by its mask)."""
        for token in tokens:
            if self.matcher.is_stopped():  # complete: only eos was allowed, and the request ends on it
                break
            self.matcher.consume_token(token)

    def processor(self) -> Any:
        """The batch's logits processor going on from here (the request rejoins the batch)."""
        return self.grammars.processor(matcher=self.matcher)
