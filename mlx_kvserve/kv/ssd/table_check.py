"""A block's array table checked against the model's layout, before its payload is read or used.

The checksum says a file is the one this folder's server wrote (folder_key.py); the table check
says its arrays are ones this model's cache can take: the names the layout has, each with its dtype
and shape, positions bounded by the block size. Without it a table naming a wrong shape or dtype
reaches mlx's reshape or the cache assembly and fails the request (a 500) every time the block is
looked up. `check_table` works on one block entry (its slots, its payload's size, its token count),
so a file holding several blocks checks each entry the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from ...checked_json import DamagedFileError, Int, MapOf, Obj, Schema, Str, read_json
from .format import ArraySlot, BlockHeader, FormatError, atomic_write, decode_table

TOKEN_AXIS = 2  # keys, values and their quantized parts: (1, heads, positions, dim)
RULES_FILE = "table_rules.json"
MAX_RULES_BYTES = 4 * 1024 * 1024


class ArrayRule(NamedTuple):
    """What one named array of a block may be."""

    dtype: str
    shape: tuple[int, ...]  # per_token: any value on TOKEN_AXIS (the probe's 1 there)
    per_token: bool  # TOKEN_AXIS counts positions; else the shape is fixed (a recurrent state)
    required: bool  # in every block and tail (full attention); else absent with its whole layer


class TableExpectation(NamedTuple):
    """Every array a block or tail of one model's layout may hold, by name (kv/table_rules.py)."""

    rules: Mapping[str, ArrayRule]
    block_size: int

    def to_json(self) -> str:
        rules = {n: [r.dtype, list(r.shape), r.per_token, r.required] for n, r in sorted(self.rules.items())}
        return json.dumps({"block_size": self.block_size, "rules": rules}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TableExpectation:
        """Raises ValueError (or TypeError, KeyError) unless `text` is what to_json writes."""
        doc = json.loads(text)
        rules = {
            str(n): ArrayRule(str(d), tuple(int(x) for x in s), bool(t), bool(r))
            for n, (d, s, t, r) in doc["rules"].items()
        }
        return cls(rules, int(doc["block_size"]))


def layer_of(name: str) -> str:
    """The layer part of an array name (format.py's names are `<layer>.<part>`)."""
    return name.partition(".")[0]


def check_table(
    slots: Sequence[ArraySlot], payload_bytes: int, num_tokens: int, expect: TableExpectation | None
) -> None:
    """Raise FormatError unless the slots (decode_table's: well formed, aligned, in order) fill a
    payload of `payload_bytes` exactly and, with `expect`, hold arrays the layout can take: every
    required array, whole layers, each array's dtype and shape, `num_tokens` (1..block_size)
    positions in a full-attention array and at most that many in any other, one count per layer."""
    end = slots[-1].offset + slots[-1].nbytes if slots else 0
    if end != payload_bytes:
        raise FormatError(f"array table covers {end} bytes of a {payload_bytes}-byte payload")
    if expect is None:
        return
    if not 0 < num_tokens <= expect.block_size:
        raise FormatError(f"{num_tokens} tokens in a {expect.block_size}-token layout")
    names = {s.name for s in slots}
    layers = {layer_of(n) for n in names}
    missing = [n for n, r in expect.rules.items() if n not in names and (r.required or layer_of(n) in layers)]
    if missing:
        raise FormatError(f"array {missing[0][:40]!r} missing")
    positions: dict[str, int] = {}
    for slot in slots:
        rule = expect.rules.get(slot.name)
        if rule is None:
            raise FormatError(f"array {slot.name[:40]!r} is not in the layout")
        if slot.dtype != rule.dtype or len(slot.shape) != len(rule.shape):
            raise FormatError(f"array {slot.name[:40]!r}: {slot.dtype}{list(slot.shape)[:8]} for {rule.dtype}")
        if not rule.per_token:
            if slot.shape != rule.shape:
                raise FormatError(f"array {slot.name[:40]!r}: shape {list(slot.shape)[:8]}, not {list(rule.shape)}")
            continue
        n = slot.shape[TOKEN_AXIS]
        fixed = [x for i, x in enumerate(slot.shape) if i != TOKEN_AXIS]
        if fixed != [x for i, x in enumerate(rule.shape) if i != TOKEN_AXIS] or n > num_tokens:
            raise FormatError(f"array {slot.name[:40]!r}: shape {list(slot.shape)[:8]} for {num_tokens} tokens")
        if (rule.required and n != num_tokens) or positions.setdefault(layer_of(slot.name), n) != n:
            raise FormatError(f"array {slot.name[:40]!r}: {n} positions, its layer another count")


def table_checker(expect: TableExpectation | None) -> Callable[[BlockHeader, int], None]:
    """format.py's TableCheck for `expect`: a read file's header checked before its payload is read."""

    def check(header: BlockHeader, payload_bytes: int) -> None:
        check_table(decode_table(header.table), payload_bytes, len(header.token_ids), expect)

    return check


# --- the rules kept beside the blocks, for `cache verify` (which has no model to probe) ----------


def save_rules(folder: Path, rules: TableExpectation) -> None:
    """Write `rules` to the folder's RULES_FILE unless it holds them already (the owner, at startup).
    Only `cache verify` reads it; a server probes its model. Raises OSError."""
    text = rules.to_json()
    try:
        if read_rules(folder) == rules:
            return
    except (OSError, ValueError):
        pass
    atomic_write(folder / RULES_FILE, text.encode())


class _RuleSchema(Schema):
    """One rule as to_json writes it: [dtype, shape, per_token, required]."""

    def check(self, value: object, where: str) -> list:
        ok = isinstance(value, list) and len(value) == 4 and isinstance(value[0], str) and len(value[0]) < 16
        ok = ok and isinstance(value[1], list) and len(value[1]) <= 8
        ok = ok and all(type(x) is int and 0 <= x < 2**31 for x in value[1])
        if not ok or not all(isinstance(x, bool) for x in value[2:]):
            raise DamagedFileError(f"{where}: expected [dtype, shape, per_token, required]")
        return value


RULES_SCHEMA = Obj({"block_size": Int(1, 2**20), "rules": MapOf(Str(64), _RuleSchema(), 1_000_000)})


def read_rules(folder: Path) -> TableExpectation:
    """The rules a server of this folder wrote. Raises FileNotFoundError, DamagedFileError or
    another ValueError when the file is missing or unusable."""
    doc = read_json(folder / RULES_FILE, RULES_SCHEMA, MAX_RULES_BYTES)
    return TableExpectation.from_json(json.dumps(doc))
