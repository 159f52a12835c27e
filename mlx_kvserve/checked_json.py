"""The JSON files the server keeps beside its models and cache (the SSD index, pins, the shutdown
record, the fingerprint memo, the GGUF conversion marker), read as untrusted input.

Anything can be in them: a crash, a full disk, a careless edit or another local process. So every
such file is read here and nowhere else: only a regular file is read (safe_files.py: opened
with O_NONBLOCK and checked with fstat, so a FIFO in its place cannot hang the server), at most
`max_bytes` of it, parsed with NaN/Infinity and over-long integers refused (deep nesting and huge
numbers are caught), then checked against a small declarative schema (types, ranges, finite numbers, hex lengths). `load_json` sets a bad file aside
as `<name>.damaged-<UTC time>` in its folder (at most KEEP_DAMAGED per name, so the disk never
fills) and returns a DamagedFile for its owner to report; the owner rebuilds the file. Nothing here
raises for bad content. This module sits beside config/errors: kv/ and models/ both use it (it
needs only safe_files.py, which imports nothing of the package).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .safe_files import NotRegularFileError, open_regular

log = logging.getLogger(__name__)

KEEP_DAMAGED = 3  # set-aside copies kept per file name; older ones are deleted
_MAX_INT_DIGITS = 40  # beyond any value a bookkeeping file holds; int() of a huge literal is slow


class DamagedFileError(ValueError):
    """A bookkeeping file that cannot be used; the message says why (never quotes its content)."""


class DamagedFile(NamedTuple):
    path: Path  # where it was found
    reason: str
    moved_to: Path | None  # the set-aside copy, in the same folder; None when it could not be moved

    def as_json(self) -> dict[str, str | None]:
        """For /health: names only (the folder is known per file), never absolute paths."""
        moved = self.moved_to.name if self.moved_to is not None else None
        return {"file": self.path.name, "reason": self.reason, "moved_to": moved}


class Loaded(NamedTuple):
    value: Any  # the checked (and built) value; None when the file is absent or damaged
    damaged: DamagedFile | None  # set when the file was there but unusable


# --- schema: each node checks a parsed JSON value and returns the value to use ------------------


class Schema:
    def check(self, value: Any, where: str) -> Any:
        """The value to use; raises DamagedFileError naming `where` and what was expected."""
        raise NotImplementedError


def _fail(where: str, expected: str) -> DamagedFileError:
    return DamagedFileError(f"{where or 'the file'}: expected {expected}")


@dataclass(frozen=True)
class Bool(Schema):
    def check(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise _fail(where, "true or false")
        return value


@dataclass(frozen=True)
class Int(Schema):
    lo: int
    hi: int

    def check(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise _fail(where, f"an integer in [{self.lo}, {self.hi}]")
        return value


@dataclass(frozen=True)
class Float(Schema):
    lo: float = -math.inf
    hi: float = math.inf

    def check(self, value: Any, where: str) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise _fail(where, f"a finite number in [{self.lo}, {self.hi}]")
        return float(value)


@dataclass(frozen=True)
class Str(Schema):
    max_len: int

    def check(self, value: Any, where: str) -> str:
        # Lone surrogates pass: paths that are not UTF-8 read back that way. Callers compare such
        # strings, never echo them (nor does any message here).
        if not isinstance(value, str) or len(value) > self.max_len:
            raise _fail(where, f"a string of at most {self.max_len} characters")
        return value


@dataclass(frozen=True)
class Hex(Schema):
    num_bytes: int

    def check(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{2 * self.num_bytes}}}", value):
            raise _fail(where, f"{2 * self.num_bytes} lowercase hex digits")
        return value


@dataclass(frozen=True)
class Const(Schema):
    value: Any

    def check(self, value: Any, where: str) -> Any:
        if type(value) is not type(self.value) or value != self.value:  # True == 1, but not here
            raise _fail(where, repr(self.value))
        return value


@dataclass(frozen=True)
class Obj(Schema):
    """An object with these fields, all required, and the `optional` ones where present (checked
    the same way; absent ones are absent from the result). Other fields are ignored (and not
    returned), so a newer writer may add some."""

    fields: Mapping[str, Schema] = field(default_factory=dict)
    optional: Mapping[str, Schema] = field(default_factory=dict)

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _fail(where, "an object")
        out = {}
        for name, schema in self.fields.items():
            if name not in value:
                raise _fail(f"{where}.{name}" if where else name, "a value (missing)")
            out[name] = schema.check(value[name], f"{where}.{name}" if where else name)
        for name, schema in self.optional.items():
            if name in value:
                out[name] = schema.check(value[name], f"{where}.{name}" if where else name)
        return out


@dataclass(frozen=True)
class MapOf(Schema):
    """An object used as a map: every key checked by `key` (a string schema), every value by `value`."""

    key: Schema
    value: Schema
    max_items: int

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict) or len(value) > self.max_items:
            raise _fail(where, f"an object of at most {self.max_items} entries")
        out = {}
        for k, v in value.items():
            at = f"{where}[{_short(k)}]"
            out[self.key.check(k, f"{at} (key)")] = self.value.check(v, at)
        return out


def _short(text: str) -> str:
    return repr(text if len(text) <= 20 else text[:20] + "…")


# --- reading -------------------------------------------------------------------------------------


def read_json(path: Path, schema: Schema, max_bytes: int) -> Any:
    """The checked content of `path`. Raises FileNotFoundError when there is no file, else
    DamagedFileError for anything wrong: not a regular file, unreadable, over `max_bytes`, not
    JSON, nested too deeply, or not matching `schema`. Never blocks on a FIFO or device."""
    return parse_json(_read_regular(path, max_bytes), schema)


def parse_json(data: bytes, schema: Schema) -> Any:
    """Parse and check `data`; raises DamagedFileError."""
    try:
        doc = json.loads(data, parse_constant=_refuse_constant, parse_int=_bounded_int)
    except RecursionError:
        raise DamagedFileError("nested too deeply") from None
    except ValueError as exc:  # also UnicodeDecodeError, and our refusals
        raise DamagedFileError(f"not valid JSON ({_first_line(exc)})") from None
    return schema.check(doc, "")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _read_regular(path: Path, max_bytes: int) -> bytes:
    # Links are followed: the file a link names is checked like any other (safe_files.py).
    try:
        fd = open_regular(path, follow_links=True)
    except FileNotFoundError:
        raise
    except NotRegularFileError as exc:
        raise DamagedFileError(str(exc)) from None
    except OSError as exc:
        raise DamagedFileError(f"cannot open ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:  # refused unread
                raise DamagedFileError(f"{size} bytes, more than the {max_bytes} allowed")
            data = f.read(max_bytes + 1)  # the file may grow meanwhile
        except OSError as exc:
            raise DamagedFileError(f"cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise DamagedFileError(f"more than the {max_bytes} bytes allowed")
    return data


def load_json(
    path: Path,
    schema: Schema,
    max_bytes: int,
    what: str,
    build: Callable[[Any], Any] | None = None,
) -> Loaded:
    """read_json, then `build` (checked value -> the owner's object; raises ValueError for content
    that passes the schema but is not usable, e.g. another namespace). A damaged file is logged and
    set aside; the caller starts without it (and rebuilds it). Never raises for a bad file."""
    try:
        value = read_json(path, schema, max_bytes)
        return Loaded(build(value) if build is not None else value, None)
    except FileNotFoundError:
        return Loaded(None, None)
    except ValueError as exc:  # DamagedFileError or build's refusal
        return Loaded(None, set_aside(path, str(exc), what))


def set_aside(path: Path, reason: str, what: str) -> DamagedFile:
    """Rename a damaged file (or folder, FIFO, link) to `<name>.damaged-<UTC time>` beside it,
    keeping the newest KEEP_DAMAGED of them. Logged; never raises."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    for n in range(1, 100):
        if not os.path.lexists(target):
            break
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    try:
        os.rename(path, target)
    except OSError as exc:
        log.error("%s %s is damaged (%s) and could not be set aside (%s); starting without it", what, path, reason, exc)
        return DamagedFile(path, reason, None)
    log.warning("%s %s is damaged (%s): set aside as %s; starting without it", what, path, reason, target.name)
    _trim_set_aside(path)
    return DamagedFile(path, reason, target)


def _trim_set_aside(path: Path) -> None:
    copies = sorted(p for p in path.parent.glob(f"{glob_escape(path.name)}.damaged-*"))
    for old in copies[:-KEEP_DAMAGED]:
        try:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        except OSError as exc:
            log.warning("could not delete the old damaged copy %s: %s", old, exc)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def remove_leftover_temps(path: Path) -> int:
    """Delete temp files an interrupted write of `path` left (`.<name>*.tmp`, `<name>.*.tmp`).
    Call only while nothing writes `path` (startup, offline). Returns how many were removed."""
    name = glob_escape(path.name)
    removed = 0
    for pattern in (f".{name}*.tmp", f"{name}.*.tmp"):
        for tmp in path.parent.glob(pattern):
            try:
                if not tmp.is_dir() or tmp.is_symlink():
                    tmp.unlink()
                    removed += 1
            except OSError as exc:
                log.warning("could not delete the leftover %s: %s", tmp, exc)
    if removed:
        log.info("removed %d leftover temp file(s) of %s", removed, path)
    return removed
