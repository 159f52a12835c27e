"""What a backend reports to the router (its block layout and its block events), checked before any of it is
used.

A backend is another process, maybe another machine, an older or newer version, or something else listening
on that port: its answers are untrusted input. Each one is parsed and checked here against the shape the
server's /v1/cache/ routes write (server/router_routes.py), and comes back as a typed value; anything else
raises BadReportError naming the field and what was expected, and the follower drops that backend until it
reports sound data again. Unknown fields and unknown event names are ignored, so a newer server may add some.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from ..chain import HASH_BYTES
from ..checked_json import Bool, DamagedFileError, Int, Obj, Schema, Str

MAX_BLOCK_SIZE = 1 << 20  # tokens per block; far above any real one, and hashable (the count is a u32)
MAX_SEQ = 2**62  # the server's event numbers, as its `since` parameter bounds them
MAX_TEXT = 4096  # model names, paths, epochs
MAX_HASHES = 2_000_000  # one snapshot: every block in a backend's RAM (far more than any RAM tier holds)
MAX_EVENTS = 1_000_000  # one events message (the server sends pages of 5,000)
MAX_LAYOUT_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 160 * 1024 * 1024  # one event on the stream: a snapshot of MAX_HASHES hashes fits


class BadReportError(ValueError):
    """A backend's report the router cannot use; the message says which field and why (never its value)."""


class Layout(NamedTuple):
    model: str
    model_path: str
    enabled: bool  # False: no block cache there (namespace None, block_size 0): routed by load alone
    namespace: bytes | None
    block_size: int
    epoch: str


class Snapshot(NamedTuple):
    """Every block the backend holds in RAM, current from `seq`."""

    epoch: str
    seq: int
    hashes: list[bytes]


class Events(NamedTuple):
    """(is_stored, hash) in the order the backend's RAM changed, up to `seq`."""

    epoch: str
    seq: int
    events: list[tuple[bool, bytes]]


def _hash(value: Any, where: str) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != HASH_BYTES:
        raise DamagedFileError(f"{where}: expected {2 * HASH_BYTES} hex digits")
    return raw


class _Hash(Schema):
    def check(self, value: Any, where: str) -> bytes:
        return _hash(value, where)


class _Hashes(Schema):
    def check(self, value: Any, where: str) -> list[bytes]:
        if not isinstance(value, list) or len(value) > MAX_HASHES:
            raise DamagedFileError(f"{where}: expected a list of at most {MAX_HASHES} hashes")
        return [_hash(h, f"{where}[{i}]") for i, h in enumerate(value)]


class _EventList(Schema):
    def check(self, value: Any, where: str) -> list[tuple[bool, bytes]]:
        if not isinstance(value, list) or len(value) > MAX_EVENTS:
            raise DamagedFileError(f"{where}: expected a list of at most {MAX_EVENTS} events")
        out = []
        for i, event in enumerate(value):
            if not (isinstance(event, list) and len(event) == 2 and event[0] in ("stored", "removed")):
                raise DamagedFileError(f'{where}[{i}]: expected ["stored" or "removed", hash]')
            out.append((event[0] == "stored", _hash(event[1], f"{where}[{i}]")))
        return out


_TEXT = Str(MAX_TEXT)
_SEQ = Int(0, MAX_SEQ)
_LAYOUT = Obj({"enabled": Bool()}, optional={"model": _TEXT, "model_path": _TEXT})
_CACHE_LAYOUT = Obj({"namespace": _Hash(), "block_size": Int(1, MAX_BLOCK_SIZE), "epoch": _TEXT})
_MESSAGES: dict[str, Schema] = {
    "snapshot": Obj({"epoch": _TEXT, "seq": _SEQ, "hashes": _Hashes()}),
    "events": Obj({"epoch": _TEXT, "seq": _SEQ, "events": _EventList()}),
}


def _load(what: str, data: bytes | str) -> Any:
    try:
        return json.loads(data)  # NaN or a huge number fails the schema's types and bounds afterwards
    except RecursionError:
        raise BadReportError(f"{what}: nested too deeply") from None
    except ValueError:
        raise BadReportError(f"{what}: not JSON") from None


def _check(what: str, value: Any, schema: Schema) -> dict[str, Any]:
    try:
        return schema.check(value, what)
    except DamagedFileError as exc:
        raise BadReportError(str(exc)) from None


def parse_layout(data: bytes) -> Layout:
    """The body of GET /v1/cache/layout. Raises BadReportError."""
    if len(data) > MAX_LAYOUT_BYTES:
        raise BadReportError(f"layout: more than {MAX_LAYOUT_BYTES} bytes")
    value = _load("layout", data)
    base = _check("layout", value, _LAYOUT)
    model, model_path = base.get("model", ""), base.get("model_path", "")
    if not base["enabled"]:
        return Layout(model, model_path, False, None, 0, "")
    cache = _check("layout", value, _CACHE_LAYOUT)
    return Layout(model, model_path, True, cache["namespace"], cache["block_size"], cache["epoch"])


def parse_message(name: str, data: bytes | str) -> Snapshot | Events | None:
    """One server-sent event of GET /v1/cache/events: a Snapshot, Events, or None for a name the router does
    not use. Raises BadReportError."""
    schema = _MESSAGES.get(name)
    if schema is None:
        return None
    message = _check(name, _load(name, data), schema)
    if name == "snapshot":
        return Snapshot(message["epoch"], message["seq"], message["hashes"])
    return Events(message["epoch"], message["seq"], message["events"])
