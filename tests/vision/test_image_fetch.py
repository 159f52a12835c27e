"""Image URLs ([server] fetch_image_urls) cannot be used to reach what only the server reaches: loopback,
link-local, private and multicast addresses and numeric host forms are refused, after DNS (the connection
goes to the checked address) and after every redirect; one deadline bounds the whole fetch; every failure
is the same 400, which never says what answered. Local HTTP servers on 127.0.0.1 and 127.0.0.2 stand in
for the web: a test makes one of them "public" with the policy's `allowed`, or opts into private
addresses (fetch_private)."""

from __future__ import annotations

import io
import ipaddress
import shutil
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_kvserve.errors import InvalidRequestError
from mlx_kvserve.vision.fetch import FetchError, FetchPolicy, address_allowed, fetch, literal_address
from mlx_kvserve.vision.images import FETCH_FAILED, ImageLimits, ImageRef, image_bytes

WHERE = "messages[0].content[0]"


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


PNG = png_bytes()


class Site:
    """An HTTP server on `host` with a route per path: (status, headers, body) or a callable given the
    handler. `hits` lists (path, Host header) of every request it received."""

    def __init__(self, host: str = "127.0.0.1"):
        self.routes: dict = {"/img.png": (200, {"Content-Type": "image/png"}, PNG)}
        self.hits: list[tuple[str, str]] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                site.hits.append((self.path, self.headers.get("Host", "")))
                route = site.routes.get(self.path, (404, {}, b"nothing here"))
                if callable(route):
                    return route(self)
                status, headers, body = route
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site():
    s = Site()
    yield s
    s.close()


@pytest.fixture
def public_site():
    """A server on 127.0.0.2 that the policies below treat as a public address."""
    s = Site("127.0.0.2")
    yield s
    s.close()


PUBLIC = ipaddress.ip_address("127.0.0.2")


def only_public(ip, allow_private) -> bool:
    """The real rule, except that 127.0.0.2 stands for a public address."""
    return ip == PUBLIC or address_allowed(ip, allow_private)


def fetched(url: str, private: bool = False, timeout_s: float = 5.0) -> bytes:
    limits = ImageLimits(fetch_urls=True, fetch_private=private, fetch_timeout_s=timeout_s)
    return image_bytes(ImageRef(url, WHERE), limits)


def refused_message(url: str, **kwargs) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        fetched(url, **kwargs)
    return caught.value.message


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "::1", "169.254.169.254", "fe80::1", "10.1.2.3", "172.16.0.1", "172.31.255.255",
        "192.168.1.1", "fc00::1", "fd12:3456::1", "224.0.0.1", "239.1.2.3", "ff02::1", "ff0e::1", "0.0.0.0",
        "::", "255.255.255.255", "100.64.0.1", "::ffff:127.0.0.1", "::ffff:8.8.8.8", "2002:7f00:1::",
        "64:ff9b::a9fe:a9fe", "240.0.0.1",
    ],
)  # fmt: skip
def test_local_private_and_odd_addresses_are_refused(address):
    assert not address_allowed(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "64:ff9b::808:808"])
def test_public_addresses_are_allowed(address):
    assert address_allowed(ipaddress.ip_address(address))


def test_the_private_opt_in_takes_lan_and_loopback_never_link_local():
    for address in ("10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1", "127.0.0.1", "::1", "fd00::1"):
        assert address_allowed(ipaddress.ip_address(address), allow_private=True), address
    for address in ("169.254.169.254", "fe80::1", "224.0.0.1", "0.0.0.0", "::", "::ffff:10.0.0.1"):
        assert not address_allowed(ipaddress.ip_address(address), allow_private=True), address


@pytest.mark.parametrize("host", ["2130706433", "0177.0.0.1", "0x7f.0.0.1", "0x7f000001", "127.1", "::ffff:127.0.0.1"])
def test_numeric_host_forms_are_refused_before_resolving(host):
    with pytest.raises(FetchError):
        literal_address(host)


def test_names_and_canonical_addresses_pass_the_host_check():
    assert literal_address("images.example.com") is None
    assert literal_address("8.8.8.8") == ipaddress.ip_address("8.8.8.8")


def test_loopback_and_its_disguises_are_refused_without_a_connection(site):
    port = site.server.server_address[1]
    for url in (
        f"{site.base}/img.png",
        f"http://localhost:{port}/img.png",
        f"http://2130706433:{port}/img.png",
        f"http://0177.0.0.1:{port}/img.png",
        f"http://127.1:{port}/img.png",
        f"http://[::ffff:127.0.0.1]:{port}/img.png",
    ):
        assert refused_message(url) == f"{WHERE}: {FETCH_FAILED}", url
    assert site.hits == []


def test_with_the_private_opt_in_a_local_image_is_fetched(site):
    assert fetched(f"{site.base}/img.png", private=True) == PNG


def test_every_failure_is_the_same_answer(site):
    """A closed port, a 404, a 500 and a refused address read alike: no port scanner."""
    site.routes["/boom"] = (500, {}, b"Traceback: secret internals")
    closed = Site()
    closed_url = f"{closed.base}/img.png"
    closed.close()
    messages = {
        refused_message(closed_url, private=True),
        refused_message(f"{site.base}/missing", private=True),
        refused_message(f"{site.base}/boom", private=True),
        refused_message(f"{site.base}/img.png"),
        refused_message("http://169.254.169.254/latest/meta-data/", private=True),
    }
    assert messages == {f"{WHERE}: {FETCH_FAILED}"}


def test_the_connection_goes_to_the_checked_address(site):
    """A name is resolved once; the connection goes to that address (never resolved again, so a DNS
    answer that changes between check and connect changes nothing), speaking to the name."""
    port = site.server.server_address[1]
    answers = iter([["127.0.0.1"], ["8.8.8.8"]])  # a second lookup would get another address
    policy = FetchPolicy(5.0, 1 << 20, allow_private=True, resolver=lambda host, p: next(answers))
    assert fetch(f"http://images.test:{port}/img.png", policy) == PNG
    assert site.hits == [("/img.png", f"images.test:{port}")]
    rebinding = iter([["8.8.8.8", "127.0.0.1"]])  # one public address beside a private one: refused whole
    with pytest.raises(FetchError, match="refused addresses"):
        fetch(f"http://images.test:{port}/img.png", FetchPolicy(5.0, 1 << 20, resolver=lambda h, p: next(rebinding)))
    assert len(site.hits) == 1


def test_every_redirect_is_checked(site, public_site):
    policy = FetchPolicy(5.0, 1 << 20, allowed=only_public)
    hop = lambda url: (302, {"Location": url}, b"")  # noqa: E731
    public_site.routes["/to-loopback"] = hop(f"{site.base}/img.png")
    public_site.routes["/to-metadata"] = hop("http://169.254.169.254/latest/meta-data/")
    public_site.routes["/to-decimal"] = hop(f"http://2130706433:{site.server.server_address[1]}/img.png")
    public_site.routes["/here"] = hop("/img.png")
    public_site.routes["/loop"] = hop("/loop")
    assert fetch(f"{public_site.base}/here", policy) == PNG
    for path in ("/to-loopback", "/to-metadata", "/to-decimal", "/loop"):
        with pytest.raises(FetchError):
            fetch(public_site.base + path, policy)
    assert site.hits == []
    assert public_site.hits.count(("/loop", public_site.base.removeprefix("http://"))) == 6  # 1 + 5 redirects


def trickle(head: bytes, body_bytes: int, every_s: float):
    def serve(handler) -> None:
        try:
            handler.wfile.write(head)
            for _ in range(body_bytes):
                handler.wfile.write(b"x")
                handler.wfile.flush()
                time.sleep(every_s)
        except OSError:  # the fetch gave up
            pass

    return serve


def test_one_deadline_for_the_whole_fetch(site):
    """A server trickling a byte every 0.1 s (each read well within the timeout) is cut at the deadline,
    in the body or in the headers."""
    site.routes["/slow-body"] = trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n", 60, 0.1)
    site.routes["/slow-unsized"] = trickle(b"HTTP/1.0 200 OK\r\n\r\n", 60, 0.1)
    site.routes["/slow-head"] = trickle(b"HTTP/1.1 200 OK\r\nX-Pad: ", 60, 0.1)
    for path in ("/slow-body", "/slow-unsized", "/slow-head"):
        start = time.monotonic()
        assert refused_message(site.base + path, private=True, timeout_s=1.0) == f"{WHERE}: {FETCH_FAILED}"
        assert time.monotonic() - start < 2.0, path


def test_a_body_over_the_limit_is_refused(site):
    site.routes["/big.png"] = (200, {}, b"x" * 2048)
    with pytest.raises(FetchError, match="over 1024"):
        fetch(f"{site.base}/big.png", FetchPolicy(5.0, 1024, allow_private=True))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a test certificate")
def test_https_speaks_to_the_name_at_the_checked_address(site, tmp_path):
    """TLS over the pinned connection: the certificate is verified against the URL's name."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1"]
        + ["-subj", "/CN=images.test", "-addext", "subjectAltName=DNS:images.test"],
        check=True,
        capture_output=True,
    )
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    site.server.socket = server_tls.wrap_socket(site.server.socket, server_side=True)
    port = site.server.server_address[1]
    policy = FetchPolicy(
        5.0,
        1 << 20,
        allow_private=True,
        resolver=lambda host, p: ["127.0.0.1"],
        tls_context=lambda: ssl.create_default_context(cafile=str(cert)),
    )
    assert fetch(f"https://images.test:{port}/img.png", policy) == PNG
    with pytest.raises(FetchError, match="CERTIFICATE_VERIFY_FAILED"):
        fetch(f"https://other.test:{port}/img.png", policy)
