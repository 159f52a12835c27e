"""Image URLs fetched for a client ([server] fetch_image_urls), without letting the client use the server to
reach what only it can reach.

A URL names a host the client picks, so a fetch could read the server's own admin API (loopback), a cloud
metadata service (link-local) or a LAN (private addresses), or map which ports answer there. Hence:
- a host is a name or a canonical address: decimal, octal and hex forms (`2130706433`, `0177.0.0.1`,
  `127.1`) and IPv4-mapped IPv6 are refused before anything is resolved;
- a name is resolved once, every address checked (`address_allowed`), and the connection goes to a checked
  address, never to the name again (a DNS answer that changes between check and connect changes nothing);
- redirects are followed by hand (at most `max_redirects`), each hop checked the same way;
- one deadline covers the whole fetch (resolve, connect, TLS, headers, body): a watchdog shuts the socket
  down when it passes, so a server trickling a byte a second cannot hold the request;
- why a fetch failed goes to the log, never to the client: refused, unreachable, timed out and an HTTP error
  are one FetchError whose `reason` the caller logs (images.py answers one generic 400).

Proxies from the environment are not used: a proxy resolves names itself, past these checks.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 64 * 1024
# Fetched only with [server] fetch_private_urls: a LAN's own addresses and this machine's loopback.
LAN_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8", "fc00::/7", "::1/128")
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # carries an IPv4 address in its last 32 bits
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$", re.IGNORECASE)


class FetchError(Exception):
    """The image could not be fetched; `reason` is for the server's log only (it names what answered)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (getaddrinfo, TCP)."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def address_allowed(ip: IPAddress, allow_private: bool = False) -> bool:
    """Whether a fetch may connect to `ip`: a global unicast address, or with `allow_private` one of
    LAN_NETWORKS. Never link-local (cloud metadata services live there), multicast, unspecified or
    reserved; IPv6 carrying an IPv4 address (6to4, NAT64) is judged by that address."""
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return False
        embedded = ip.sixtofour or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in NAT64 else None)
        if embedded is not None:
            return address_allowed(embedded, allow_private)
    if ip.is_multicast or ip.is_unspecified or ip.is_link_local:
        return False
    if allow_private and any(ip in net for net in LAN_NETWORKS):  # before is_reserved, which holds ::1
        return True
    return ip.is_global and not ip.is_reserved


def literal_address(host: str) -> IPAddress | None:
    """`host` as an address when it is one in canonical form, None for a name. Raises FetchError for the
    other numeric forms the C resolver would take as addresses (decimal, octal, hex, short dotted)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if _NUMERIC_LABEL.match(host.rstrip(".").rsplit(".", 1)[-1]):  # no top-level domain is numeric
            raise FetchError(f"host {host!r} is a numeric form other than a dotted-decimal address") from None
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        raise FetchError(f"host {host!r} is an IPv4-mapped IPv6 address")
    return ip


@dataclass(frozen=True)
class FetchPolicy:
    """How one image URL is fetched. `allowed` decides each address (tests replace it); `resolver` maps a
    name and port to addresses; `tls_context` makes the context that verifies an https host's name."""

    timeout_s: float
    max_bytes: int
    allow_private: bool = False
    max_redirects: int = MAX_REDIRECTS
    resolver: Callable[[str, int], Sequence[str]] = system_resolver
    allowed: Callable[[IPAddress, bool], bool] = field(default=address_allowed)
    tls_context: Callable[[], ssl.SSLContext] = ssl.create_default_context


class _Deadline:
    """The fetch's one deadline: seconds left, and a watchdog that shuts the current socket down when it
    passes (a blocked read then returns at once, however the server trickles)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self._lock = threading.Lock()  # guards _sock and _expired
        self._sock: socket.socket | None = None
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        """Seconds left; FetchError once none are."""
        left = self.end - time.monotonic()
        if left <= 0 or self.expired:
            raise FetchError("timed out")
        return left

    @property
    def expired(self) -> bool:
        with self._lock:
            return self._expired

    def watch(self, sock: socket.socket | None) -> None:
        """Shut `sock` down when the deadline passes (at once if it has); None: nothing to watch."""
        with self._lock:
            self._sock = sock
            if self._expired:
                self._shutdown()

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):  # closed already
                self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def fetch(url: str, policy: FetchPolicy) -> bytes:
    """The body of a 200 answer to GET `url` (http or https), at most `policy.max_bytes`, within
    `policy.timeout_s` in all. Raises FetchError for anything else."""
    deadline = _Deadline(policy.timeout_s)
    try:
        for _ in range(policy.max_redirects + 1):
            status, location, body = _get(url, policy, deadline)
            if status not in REDIRECTS:
                if status != 200:
                    raise FetchError(f"HTTP {status}")
                return body
            if not location:
                raise FetchError(f"HTTP {status} without a Location")
            url = urljoin(url, location)
        raise FetchError(f"more than {policy.max_redirects} redirects")
    except (OSError, http.client.HTTPException, ValueError) as exc:  # network errors come in many types
        if deadline.expired or time.monotonic() >= deadline.end:
            raise FetchError("timed out") from None
        raise FetchError(f"{type(exc).__name__}: {exc}") from None
    finally:
        deadline.cancel()


def _get(url: str, policy: FetchPolicy, deadline: _Deadline) -> tuple[int, str | None, bytes]:
    """One GET: (status, Location, body: read only for a 200)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"not an http(s) URL with a host: {url[:200]!r}")
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    addresses = _checked_addresses(host, port, policy, deadline)
    conn = _connect(parts.scheme, host, port, addresses, deadline, policy.tls_context)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "mlx-kvserve"})
        reply = conn.getresponse()
        if reply.status != 200:
            return reply.status, reply.getheader("location"), b""
        declared = reply.getheader("content-length")
        if declared and declared.isdigit() and int(declared) > policy.max_bytes:
            raise FetchError(f"Content-Length {declared} is over {policy.max_bytes} bytes")
        chunks, size = [], 0
        while chunk := reply.read(CHUNK_BYTES):
            size += len(chunk)
            if size > policy.max_bytes:
                raise FetchError(f"the body is over {policy.max_bytes} bytes")
            chunks.append(chunk)
        deadline.left()  # a body without a length ends when the watchdog shuts the socket: not a whole body
        return 200, None, b"".join(chunks)
    finally:
        deadline.watch(None)
        conn.close()


def _checked_addresses(host: str, port: int, policy: FetchPolicy, deadline: _Deadline) -> list[IPAddress]:
    """The addresses to connect to for `host`: every one allowed, or FetchError (a name that resolves to
    any refused address is refused whole)."""
    literal = literal_address(host)
    if literal is not None:
        found = [literal]
    else:
        try:
            found = [ipaddress.ip_address(a.split("%", 1)[0]) for a in _resolve(policy, host, port, deadline)]
        except (OSError, ValueError) as exc:
            raise FetchError(f"cannot resolve {host!r}: {exc}") from None
    refused = [str(ip) for ip in found if not policy.allowed(ip, policy.allow_private)]
    if refused or not found:
        raise FetchError(f"{host!r} resolves to refused addresses {refused}" if refused else f"{host!r}: no address")
    return found


def _resolve(policy: FetchPolicy, host: str, port: int, deadline: _Deadline) -> Sequence[str]:
    """policy.resolver(host, port) within the deadline (the system resolver has no timeout of its own)."""
    result: list[Sequence[str]] = []
    errors: list[Exception] = []

    def run() -> None:
        try:
            result.append(policy.resolver(host, port))
        except Exception as exc:  # resolvers raise their own types
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(deadline.left())
    if errors:
        raise OSError(str(errors[0]))
    if not result:
        raise FetchError("timed out resolving")
    return result[0]


def _connect(
    scheme: str,
    host: str,
    port: int,
    addresses: list[IPAddress],
    deadline: _Deadline,
    tls_context: Callable[[], ssl.SSLContext],
) -> http.client.HTTPConnection:
    """A connection to the first of `addresses` that accepts, speaking to `host` (Host header, TLS name)."""
    last: Exception = FetchError("no address")
    for ip in addresses:
        try:
            sock = socket.create_connection((str(ip), port), timeout=deadline.left())
        except OSError as exc:
            last = exc
            continue
        deadline.watch(sock)
        if scheme == "https":
            sock = tls_context().wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
            deadline.watch(sock)  # wrapping took over the socket: watch the new one before the handshake
            sock.do_handshake()
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection  # its default port
        conn = cls(host, port, timeout=deadline.left())
        conn.sock = sock  # connected already: http.client sends over it and never resolves `host`
        return conn
    raise last
