"""Local means local: no web page the user opens can use the server (docs/operations.md, "Security model").

A browser lets any page send a "simple" request (a form POST, `fetch` with `mode: "no-cors"`, a
`text/plain` body) to 127.0.0.1 without asking the server first, and through DNS rebinding (a name the
attacker controls, re-pointed at 127.0.0.1) even read the answer. Two checks, before the API key gate:

- Host: a request must name the server by a loopback name (localhost, 127.0.0.1, [::1]), the address it
  is bound to (any IP address when bound to all of them) or a name in `allowed_hosts`; else 421. A
  rebinding page's requests carry the attacker's name. Not checked when every endpoint but /health
  needs an API key: such a page cannot send the key, and LAN clients may use any name.
- Origin: browsers name the page that sent a request in `Origin`. A request from another page than the
  server's own (Origin == http(s)://<Host>) gets 403 unless its origin is in `allowed_origins`; only
  then are CORS headers sent and preflights answered. Without `Origin`, a `Sec-Fetch-Site` of
  cross-site or same-site on anything but a navigation (an <img> or <script> load) gets 403 too.
  Clients that are not browsers (curl, SDKs) send neither header and are unaffected.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigError
from .openai.reply import error_body

log = logging.getLogger(__name__)
LOOPBACK_NAMES = frozenset({"localhost"})  # names; loopback IP literals are recognised as such
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})  # bound to every address of the machine
# What a proxy in front of a guarded app drops: the browser's request was checked here, and the hop
# to the next server (a backend, a model's process) has another Host, so its check would fail.
BROWSER_HEADERS = frozenset({"origin", "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_MAX_AGE_S = 600
_MAX_LOGGED = 64  # distinct refused hosts/origins logged as warnings; later ones at debug (a page may loop)


def host_name(value: str) -> str | None:
    """The lowercased name of a Host header or `host[:port]` (IPv6 without brackets); None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        ok = sep and (not rest or (rest[:1] == ":" and rest[1:].isdigit()))
        return name if ok and name else None
    name, _, port = value.partition(":")
    if not name or (port and not port.isdigit()) or "/" in name or "@" in name:
        return None
    return name


def is_loopback(name: str) -> bool:
    """True for a loopback name or IP literal (127.0.0.0/8, ::1)."""
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def origin_netloc(origin: str) -> str | None:
    """`host[:port]` of an `Origin` value (http or https, nothing after the port), lowercased; else None."""
    scheme, sep, netloc = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or host_name(netloc) is None:
        return None
    return netloc


@dataclass(frozen=True)
class GuardPolicy:
    """Who may send requests: built once by `guard_policy`, read by LocalGuard."""

    bind_host: str
    allowed_hosts: frozenset[str]  # extra names (lowercased); "*" = any Host
    allowed_origins: frozenset[str]  # exact origins (lowercased, no trailing slash) that get CORS
    checks_host: bool = True  # False when an API key guards the endpoints (see the module docstring)

    def host_allowed(self, name: str) -> bool:
        if "*" in self.allowed_hosts or is_loopback(name) or name in self.allowed_hosts:
            return True
        # An IP literal names no attacker's DNS: allowed when the server answers on every address.
        return name == self.bind_host or (self.bind_host in WILDCARD_BINDS and _is_ip(name))


def _allowed_name(value: str) -> str | None:
    """An `allowed_hosts` entry as host_name reads it ("*", a name, an IP; no port); None when it is none."""
    value = value.strip().lower()
    if value == "*":
        return value
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if ":" in inner:  # only an IPv6 literal may hold a colon here: no ports
        return inner if _is_ip(inner) else None
    return host_name(inner)


def guard_policy(
    bind_host: str, allowed_hosts: Iterable[str], allowed_origins: Iterable[str], section: str, has_key: bool = False
) -> GuardPolicy:
    """The policy for a server bound to `bind_host`, whose endpoints need an API key when `has_key`.
    ConfigError naming `<section>.allowed_hosts` or `<section>.allowed_origins` for an entry that is no
    host name or no `scheme://host[:port]` origin."""
    hosts = set()
    for value in allowed_hosts:
        name = _allowed_name(value)
        if name is None:
            raise ConfigError(
                f"{section}.allowed_hosts: {value!r} is no host name (give names without a port or scheme)",
                param=f"{section}.allowed_hosts",
            )
        hosts.add(name)
    origins = set()
    for value in allowed_origins:
        origin = value.strip().lower().rstrip("/")
        if origin != "null" and origin_netloc(origin) is None:
            raise ConfigError(
                f"{section}.allowed_origins: {value!r} is no origin (give scheme://host[:port], as browsers send it)",
                param=f"{section}.allowed_origins",
            )
        origins.add(origin)
    bind = host_name(bind_host) or bind_host.strip("[]").lower()
    return GuardPolicy(bind, frozenset(hosts), frozenset(origins), checks_host=not has_key)


def check_exposure(bind_host: str, has_key: bool, allow_no_key: bool, section: str) -> str | None:
    """Refuse (ConfigError) to listen beyond loopback without an API key unless `<section>.allow_no_key`;
    the warning to log loudly when allowed, None when there is nothing to say."""
    name = host_name(bind_host) or bind_host
    if has_key or is_loopback(name):
        return None
    what = f"listening on {bind_host or 'every address'} without an API key"
    if not allow_no_key:
        raise ConfigError(
            f"{what}: anyone who can reach this address could use it. Set an API key, or "
            f"{section}.allow_no_key = true to serve the network without one",
            param=f"{section}.allow_no_key",
        )
    return f"{what} ({section}.allow_no_key = true): ANYONE WHO CAN REACH IT CAN USE IT"


class Verdict(NamedTuple):
    """What to do with one request: refuse (status > 0), answer a preflight, or pass on (with CORS
    headers for `cors_origin` when set)."""

    status: int = 0
    code: str = ""
    message: str = ""
    cors_origin: str = ""
    is_preflight: bool = False


def decide(policy: GuardPolicy, method: str, headers: Headers) -> Verdict:
    """The verdict on a request with these headers: pure, no I/O."""
    host = headers.get("host", "")
    name = host_name(host)
    if policy.checks_host and (name is None or not policy.host_allowed(name)):
        return Verdict(
            421,
            "host_not_allowed",
            f"this server does not answer to the host {host!r}: use localhost or 127.0.0.1, or add the name to "
            "allowed_hosts (a check against DNS rebinding)",
        )
    origin = headers.get("origin")
    if origin is None:
        site, mode = headers.get("sec-fetch-site", ""), headers.get("sec-fetch-mode", "")
        if site in ("cross-site", "same-site") and mode != "navigate":
            return Verdict(403, "cross_site_request", f"a {site} request from a web page is refused")
        return Verdict()
    origin = origin.strip().lower()
    if origin_netloc(origin) == host.strip().lower():
        return Verdict()  # the server's own page (/ui)
    if origin not in policy.allowed_origins:
        return Verdict(
            403,
            "origin_not_allowed",
            f"requests from the web page at {origin!r} are refused: add its origin to allowed_origins to allow it",
        )
    preflight = method == "OPTIONS" and "access-control-request-method" in headers
    return Verdict(cors_origin=origin, is_preflight=preflight)


class LocalGuard:
    """ASGI middleware, outermost: applies `decide` to every HTTP request (421/403 with an OpenAI-style
    error body), answers CORS preflights for allowed origins and adds CORS headers to their replies."""

    def __init__(self, app: ASGIApp, policy: GuardPolicy):
        self.app = app
        self.policy = policy
        self.logged: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        verdict = decide(self.policy, scope["method"], headers)
        if verdict.status:
            self._log(verdict, headers)
            body = error_body(verdict.message, "invalid_request_error", None, verdict.code)
            await JSONResponse(body, status_code=verdict.status)(scope, receive, send)
            return
        if not verdict.cors_origin:
            await self.app(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", verdict.cors_origin.encode()), (b"vary", b"Origin")]
        if verdict.is_preflight:
            allow = {
                "access-control-allow-methods": CORS_METHODS,
                "access-control-allow-headers": headers.get("access-control-request-headers", ""),
                "access-control-max-age": str(CORS_MAX_AGE_S),
            }
            response = Response(status_code=204, headers=allow)
            response.raw_headers += cors
            await response(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _log(self, verdict: Verdict, headers: Headers) -> None:
        what = f"{verdict.code} host={headers.get('host', '')!r} origin={headers.get('origin', '-')!r}"
        if what in self.logged or len(self.logged) >= _MAX_LOGGED:
            log.debug("refused a browser request: %s", what)
            return
        self.logged.add(what)
        log.warning("refused a browser request: %s (later ones alike are logged at debug level)", what)
