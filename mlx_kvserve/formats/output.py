"""A chat reply split, as it streams, into reasoning, content and tool calls.

The worker sends text deltas only; the markers that separate the parts (`<think>`/`</think>`,
`<tool_call>`/`</tool_call>`, whatever mlx-lm's TokenizerWrapper found for the model) appear in that
text as the special tokens' strings. A marker may arrive split over deltas, so text that could be
the start of one is held back until the next delta tells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import tool_calls as tl
from .reasoning import reasoning_state, think_markers

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


@dataclass(frozen=True)
class Segment:
    """One piece of the reply: text of `kind` (content or reasoning), or parsed tool calls."""

    kind: str
    text: str = ""
    calls: tuple[tl.ToolCall, ...] = ()


class MarkerSplitter:
    """Splits streamed text by (start, end) marker pairs. `pairs` maps a state to its markers; text
    outside every pair is CONTENT. The text of a TOOL span comes out whole, once its end arrives
    (or at finish, cut short); content and reasoning come out as soon as no marker can be forming."""

    def __init__(self, pairs: dict[str, tuple[str, str]], state: str = CONTENT):
        self.pairs = pairs
        self.state = state
        self.buffer = ""

    def _hold(self, markers: Sequence[str]) -> int:
        """Length of the longest end of the buffer that is the start of a marker."""
        for size in range(min(len(self.buffer), max(map(len, markers), default=0)), 0, -1):
            tail = self.buffer[-size:]
            if any(m.startswith(tail) for m in markers):
                return size
        return 0

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(state, text) pieces that are now certain, in order."""
        self.buffer += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == CONTENT:
                starts = {s: self.buffer.find(pair[0]) for s, pair in self.pairs.items()}
                found = [(pos, s) for s, pos in starts.items() if pos >= 0]
                if not found:
                    break
                pos, state = min(found)
                out.append((CONTENT, self.buffer[:pos]))
                self.buffer = self.buffer[pos + len(self.pairs[state][0]) :]
                self.state = state
            else:
                end = self.pairs[self.state][1]
                pos = self.buffer.find(end)
                if pos < 0:
                    break
                out.append((self.state, self.buffer[:pos]))
                self.buffer = self.buffer[pos + len(end) :]
                self.state = CONTENT
        if self.state == CONTENT:
            markers = [pair[0] for pair in self.pairs.values()]
        elif self.state == TOOL:
            return [p for p in out if p[1] or p[0] == TOOL]  # a tool span is released whole
        else:
            markers = [self.pairs[self.state][1]]
        keep = self._hold(markers)
        ready, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        out.append((self.state, ready))
        return [p for p in out if p[1] or p[0] == TOOL]

    def finish(self) -> list[tuple[str, str]]:
        """What is left: held text, or a span whose end never came (marked `cut`: state + ':cut')."""
        rest, self.buffer = self.buffer, ""
        if self.state == TOOL:
            return [(TOOL + ":cut", rest)]
        return [(self.state, rest)] if rest else []


@dataclass
class ChatOutput:
    """Turns a chat reply's text deltas into Segments for one request.

    `tokenizer`: mlx-lm's TokenizerWrapper (its think and tool-call markers, its tool parser).
    `prompt`: the prompt's token ids; a prompt that ends inside an open think block (a template
    that opens `<think>` for the assistant) starts the reply in reasoning.
    `spec`: the request's tools; calls are parsed only when it offers tools and tool_choice is not
    "none". A call the parser cannot read is returned as content, markers included, never dropped;
    with `parallel_tool_calls: false` calls after the first are left out (they are not constrained
    away, so the model may still write them).
    """

    tokenizer: Any
    prompt: Sequence[int]
    spec: tl.ToolSpec | None = None
    num_calls: int = 0
    splitter: MarkerSplitter = field(init=False)

    def __post_init__(self) -> None:
        pairs: dict[str, tuple[str, str]] = {}
        state = CONTENT
        if thinking := think_markers(self.tokenizer):
            pairs[REASONING] = thinking
            if reasoning_state(self.tokenizer, self.prompt) == "open":
                state = REASONING
        if self.spec is not None and self.spec.parses_calls and (found := tl.markers(self.tokenizer)):
            pairs[TOOL] = found
        self.splitter = MarkerSplitter(pairs, state)

    def feed(self, text: str) -> list[Segment]:
        return self._segments(self.splitter.feed(text))

    def finish(self) -> list[Segment]:
        return self._segments(self.splitter.finish())

    def _segments(self, pieces: list[tuple[str, str]]) -> list[Segment]:
        out = []
        for kind, text in pieces:
            if not kind.startswith(TOOL):
                out.append(Segment(kind, text))
                continue
            calls = tl.parse_tool_call(self.tokenizer, text, self.spec.tools) if self.spec else None
            if calls is None:  # unreadable or cut short: give the model's text back as it was written
                start, end = self.splitter.pairs[TOOL]
                out.append(Segment(CONTENT, start + text + ("" if kind.endswith(":cut") else end)))
                continue
            if not self.spec.parallel:
                calls = calls[: max(0, 1 - self.num_calls)]
            self.num_calls += len(calls)
            if calls:
                out.append(Segment(TOOL, calls=tuple(calls)))
        return out


def collect(segments: list[Segment]) -> tuple[str, str, list[tl.ToolCall]]:
    """(content, reasoning, tool calls) of a whole reply."""
    content = "".join(s.text for s in segments if s.kind == CONTENT)
    reasoning = "".join(s.text for s in segments if s.kind == REASONING)
    return content, reasoning, [c for s in segments if s.kind == TOOL for c in s.calls]
