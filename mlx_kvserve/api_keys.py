"""API keys and the principals they stand for.

`[server] api_key_file` holds one key per line, or `name: key` (a colon and a space between them);
blank lines and lines starting with # are skipped. Each inference key is a principal: with
`[cache] isolation = "per_key"` every principal caches in a namespace of its own (kv/salts.py).

A principal has a display `name` (the file's, or key-N by its place among the file's keys: logs
never show a key) and an `identity`, from which its cache namespace is derived: the file's name
when it gives one (rotating the key under the same name keeps that principal's cache), else a
digest of the key itself (so reordering unnamed keys never hands one key another's namespace).
A leaf beside config.py: only errors.py below it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

from blake3 import blake3

from .errors import ConfigError

NAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
ADMIN_IDENTITY = ":admin"  # no file name can be this (":" is not a name character)


class Principal(NamedTuple):
    name: str  # for logs
    key: str
    identity: str  # what the cache namespace is derived from (never shown)


class ApiKeys(NamedTuple):
    """The keys requests must present; "" = none needed."""

    inference: str  # the first (or only) inference key; every endpoint but /health
    admin: str  # /v1/cache/ endpoints; "" = the inference key (or none) applies there too
    principals: tuple[Principal, ...] = ()  # every inference key, when the file named some or holds several

    def named(self) -> tuple[Principal, ...]:
        """Every inference key as a principal (() when none is needed)."""
        if self.principals:
            return self.principals
        return (unnamed(self.inference, 1),) if self.inference else ()

    def admin_principal(self) -> Principal | None:
        return Principal("admin", self.admin, ADMIN_IDENTITY) if self.admin else None

    def isolated(self, isolation: str) -> bool:
        """Whether each key caches apart under `[cache] isolation` ("auto": when there are several
        inference keys; the admin key alone never makes it so)."""
        return isolation == "per_key" or (isolation == "auto" and len(self.named()) > 1)

    def whole_blocks(self, isolation: str, report_cached: str) -> bool:
        """Whether cached_tokens are reported in whole blocks under `[cache] report_cached` ("auto":
        when several inference keys share one cache)."""
        shared = len(self.named()) > 1 and not self.isolated(isolation)
        return report_cached == "blocks" or (report_cached == "auto" and shared)


def unnamed(key: str, number: int) -> Principal:
    return Principal(f"key-{number}", key, "#" + blake3(b"principal" + key.encode()).hexdigest())


def is_key_text(key: str) -> bool:
    # An Authorization header can carry nothing else, so any other key could never match.
    return key.isascii() and key.isprintable() and " " not in key


def _fail(param: str, message: str) -> ConfigError:
    return ConfigError(f"{param}: {message}", param=param)


def _read_text(path: str, param: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(param, f"cannot read {path}: {exc}") from None


def _read_key(path: str, param: str) -> str:
    text = _read_text(path, param).strip()
    if not text:
        raise _fail(param, f"{path} is empty")
    if not is_key_text(text):
        raise _fail(param, f"the key in {path} must be printable ASCII without spaces")
    return text


def parse_key_file(text: str, path: str, param: str = "server.api_key_file") -> tuple[Principal, ...]:
    """The principals of a key file's text. ConfigError (naming the line, never the key) for a line
    that is no key, a bad name, or a key or name given twice; for a file with no key."""
    found: list[Principal] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(": ")
        if sep and not NAME_RE.fullmatch(name):
            raise _fail(param, f"{path} line {number}: a name is letters, digits and _.@- (at most 64)")
        key = key.strip() if sep else line
        if not is_key_text(key):
            raise _fail(param, f"{path} line {number}: a key is printable ASCII without spaces")
        if any(p.key == key for p in found):
            raise _fail(param, f"{path} line {number}: the same key is on an earlier line")
        principal = Principal(name, key, name) if sep else unnamed(key, len(found) + 1)
        if any(p.name == principal.name for p in found):
            raise _fail(param, f"{path} line {number}: the name {principal.name!r} is on an earlier line")
        found.append(principal)
    if not found:
        raise _fail(param, f"{path} holds no key")
    return tuple(found)


def load_api_keys(server: Any) -> ApiKeys:
    """The API keys of a ServerConfig, with key files read now. Raises ConfigError naming
    `server.api_key_file` or `server.admin_api_key_file` for a missing, unreadable or empty file,
    or a key file line that is not a key."""
    principals: tuple[Principal, ...] = ()
    inference = server.api_key
    if server.api_key_file:
        principals = parse_key_file(_read_text(server.api_key_file, "server.api_key_file"), server.api_key_file)
        inference = principals[0].key
        if len(principals) == 1 and principals[0].name == "key-1":
            principals = ()  # one unnamed key: as a single api_key
    admin = _read_key(server.admin_api_key_file, "server.admin_api_key_file") if server.admin_api_key_file else ""
    admin = admin or server.admin_api_key
    if admin and any(p.key == admin for p in principals or (unnamed(inference, 1),)):
        raise _fail("server.admin_api_key", "the admin key must differ from every inference key")
    return ApiKeys(inference, admin, principals)


def key_overrides(name: str, value: str | None, path: str | None) -> dict[str, str]:
    """Overrides for `name` (api_key or admin_api_key) from a flag or variable pair: naming one source
    clears the other, so the override replaces whichever kind of key the file set. {} when neither."""
    if value and path:
        raise ConfigError(f"give {name} or {name}_file, not both", param=f"server.{name}")
    if value:
        return {name: value, f"{name}_file": ""}
    if path:
        return {name: "", f"{name}_file": path}
    return {}
