"""OpenAI Responses API replies: output items built from a chat reply's segments, the Response
object, and the streamed event sequence the `openai` SDK and Codex parse (response.created,
response.in_progress, output items with their parts and deltas, response.completed / incomplete /
failed, each with a `sequence_number`).

One OutputItems builder serves both a whole reply and a stream: it turns each Segment into the
events that open, extend and close output items, and keeps the items; a whole reply ignores the
events.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from ...engine.request import Usage
from ...formats.output import REASONING, TOOL, Segment
from .. import sse

Event = tuple[str, dict[str, Any]]  # (type, payload without type and sequence_number)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one reply, in the order the model wrote them: `message` items (one
    output_text part each), `reasoning` items (the text in `summary` when `summary`, else in
    `content`) and `function_call` items. Text of one kind that is only whitespace opens no item
    on its own (the gaps around tool calls), unless the reply has nothing else."""

    def __init__(self, summary: bool):
        self.summary = summary
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item text is being added to
        self.pending = ("", "")  # (kind, whitespace) not yet given an item

    def feed(self, segments: list[Segment]) -> list[Event]:
        events: list[Event] = []
        for seg in segments:
            if seg.kind == TOOL:
                events += self.close()
                for call in seg.calls:
                    events += self._call(call.id, call.name, call.arguments)
            elif seg.text:
                events += self._text(REASONING if seg.kind == REASONING else "message", seg.text)
        return events

    def finish(self, status: str = "completed") -> list[Event]:
        """Close the open item (`status`: completed, or incomplete when the reply was cut short)."""
        kind, text = self.pending
        events = self._open(kind, text) if text and not self.items else []
        return events + self.close(status)

    @property
    def reasoning_text(self) -> str:
        return "".join(p["text"] for i in self.items if i["type"] == "reasoning" for p in self._parts(i))

    def _parts(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        return item["summary"] if item["type"] == "reasoning" and self.summary else item["content"]

    def _text(self, kind: str, text: str) -> list[Event]:
        if self.open is not None and self.open["type"] == kind:
            return self._delta(text)
        if not text.strip():
            held = self.pending[1] if self.pending[0] == kind else ""
            self.pending = (kind, held + text)
            return []
        held = self.pending[1] if self.pending[0] == kind else ""
        return self.close() + self._open(kind, held + text)

    def _open(self, kind: str, text: str) -> list[Event]:
        index, self.pending = len(self.items), ("", "")
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            item |= {} if self.summary else {"content": []}
            part = {"type": "summary_text" if self.summary else "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        events: list[Event] = [("response.output_item.added", {"output_index": index, "item": copy.deepcopy(item)})]
        self._parts(item).append(part)
        where = {"item_id": item["id"], "output_index": index}
        if kind == REASONING and self.summary:
            events.append(("response.reasoning_summary_part.added", where | {"summary_index": 0, "part": dict(part)}))
        else:
            events.append(("response.content_part.added", where | {"content_index": 0, "part": dict(part)}))
        return events + self._delta(text)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _delta(self, text: str) -> list[Event]:
        assert self.open is not None
        self._parts(self.open)[0]["text"] += text
        if self.open["type"] == "message":
            return [("response.output_text.delta", self._where() | {"content_index": 0, "delta": text, "logprobs": []})]
        if self.summary:
            return [("response.reasoning_summary_text.delta", self._where() | {"summary_index": 0, "delta": text})]
        return [("response.reasoning_text.delta", self._where() | {"content_index": 0, "delta": text})]

    def close(self, status: str = "completed") -> list[Event]:
        item = self.open
        if item is None:
            return []
        part, where = self._parts(item)[0], self._where()
        if item["type"] == "message":
            done = [("response.output_text.done", where | {"content_index": 0, "text": part["text"], "logprobs": []})]
            done.append(("response.content_part.done", where | {"content_index": 0, "part": dict(part)}))
        elif self.summary:
            done = [("response.reasoning_summary_text.done", where | {"summary_index": 0, "text": part["text"]})]
            done.append(("response.reasoning_summary_part.done", where | {"summary_index": 0, "part": dict(part)}))
        else:
            done = [("response.reasoning_text.done", where | {"content_index": 0, "text": part["text"]})]
            done.append(("response.content_part.done", where | {"content_index": 0, "part": dict(part)}))
        item["status"] = status
        self.open = None
        return done + [
            ("response.output_item.done", {"output_index": where["output_index"], "item": copy.deepcopy(item)})
        ]

    def _call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        index, self.pending = len(self.items), ("", "")
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": ""}
        item["status"] = "in_progress"
        added = ("response.output_item.added", {"output_index": index, "item": copy.deepcopy(item)})
        where = {"item_id": item["id"], "output_index": index}
        item |= {"arguments": arguments, "status": "completed"}
        self.items.append(item)
        return [
            added,
            ("response.function_call_arguments.delta", where | {"delta": arguments}),
            ("response.function_call_arguments.done", where | {"arguments": arguments, "name": name}),
            ("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}),
        ]


def usage_body(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
        "total_tokens": usage.total_tokens,
    }


def response_body(
    rid: str,
    model: str,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The Response object. `status`: in_progress, completed, incomplete (cut by max_output_tokens)
    or failed (with `error`)."""
    body = {"id": rid, "object": "response", "created_at": created_at or int(time.time()), "status": status}
    body |= {"error": error, "model": model, "output": output, "usage": usage}
    body["incomplete_details"] = {"reason": "max_output_tokens"} if status == "incomplete" else None
    if status in ("completed", "incomplete"):
        body["completed_at"] = int(time.time())
    return body | echo


def finish_status(finish_reason: str) -> str:
    """A reply cut by max_output_tokens (or by shutdown) is incomplete."""
    return "completed" if finish_reason == "stop" else "incomplete"


class Sequencer:
    """Numbers the events of one stream from 0 and writes each as `event: <type>` + `data:`."""

    def __init__(self) -> None:
        self.next = 0

    def lines(self, events: list[Event]) -> list[str]:
        out = []
        for kind, payload in events:
            out.append(sse.event(kind, payload | {"sequence_number": self.next}))
            self.next += 1
        return out
