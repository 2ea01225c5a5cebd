"""A local HTTP file server that behaves like a model hub and a release page, for tests and the demo.

Downloads are the slowest and most fragile step of provisioning, and the real hosts are not
reachable from the lab, so this server reproduces what the download code must cope with:

* ``GET``/``HEAD`` with ``Range`` (206, ``Content-Range``, ``Accept-Ranges``), served by aiohttp's
  static-file response (sendfile, no hand-written range logic);
* the hub layout ``/<org>/<repo>/resolve/<rev>/<file>`` -> ``ROOT/<org>/<repo>/<file>``, and any other
  ``/<path>`` -> ``ROOT/<path>`` (release packs with their SHA256SUMS);
* ``/redirect/<path>``: a 302 to ``<path>`` on another host name with a signed query, the way the hub
  sends large files to its CDN (the signed URL needs no token);
* an optional bearer token (401 without it);
* optional TLS with a throwaway self-signed certificate for 127.0.0.1 and localhost (``tls=True``;
  ``ca_file`` is the certificate a client trusts, e.g. through ``SSL_CERT_FILE``), so the rule "a token
  travels only over HTTPS" can be tested for real;
* fault injection (``drop_after``: cut the connection after N body bytes), pacing (``rate``: a slower
  link) and a counter of body bytes sent, so tests and benchmarks can measure how much a resumed
  download re-fetches.

``with FileServer(root) as srv: srv.url`` runs it on 127.0.0.1 in a background thread;
``python -m lab.fileserver ROOT --port N`` runs it in the foreground.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hmac
import ipaddress
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from aiohttp import web

CHUNK_SIZE = 1 << 20


@dataclass(frozen=True)
class Seen:
    """One request as the server saw it: lets tests check where a token was (not) sent."""

    method: str
    host: str
    path: str
    authorized: bool
    range: str | None


class _CountedFileResponse(web.FileResponse):
    """A static-file response that honours the server's byte counter and ``drop_after``.

    ``_sendfile`` is the one place where aiohttp sends the body, after it has resolved the range.
    """

    def __init__(self, path: Path, server: FileServer) -> None:
        super().__init__(path, chunk_size=CHUNK_SIZE)
        self._server = server

    async def _sendfile(self, request: web.BaseRequest, fobj: Any, offset: int, count: int) -> Any:
        cut = self._server.drop_after
        send = count if cut is None else min(cut, count)
        self._server._begin_send()
        try:
            if self._server.rate:
                writer = await self._paced(request, fobj, offset, send, self._server.rate)
            else:
                writer = await super()._sendfile(request, fobj, offset, send)
        finally:
            # sendfile leaves the file position after the last byte the kernel accepted, also on error,
            # so an abandoned response counts what really went out.
            self._server._add_sent(max(0, fobj.tell() - offset))
        if send < count and request.transport is not None:
            # Close after the declared length was promised but not delivered: the client sees a
            # dropped connection, exactly like a flaky link.
            request.transport.close()
        return writer

    async def _paced(self, request: web.BaseRequest, fobj: Any, offset: int, count: int, rate: float) -> Any:
        """Send at ``rate`` bytes/s, like a WAN link, so a benchmark can be network-bound."""
        writer = await web.StreamResponse.prepare(self, request)
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), 0
        fobj.seek(offset)
        while sent < count:
            chunk = await loop.run_in_executor(None, fobj.read, min(CHUNK_SIZE, count - sent))
            sent += len(chunk)
            await asyncio.sleep(max(0.0, started + sent / rate - loop.time()))  # never ahead of the rate
            await writer.write(chunk)
        await web.StreamResponse.write_eof(self)
        return writer


class FileServer:
    """Serve ``root`` on 127.0.0.1 from a background thread; use as a context manager."""

    def __init__(
        self,
        root: str | Path,
        token: str | None = None,
        port: int = 0,
        redirect_host: str = "localhost",
        tls: bool = False,
    ) -> None:
        self.root = Path(root).resolve()
        self.token = token
        # Another name for this server, so a client following /redirect/ sees a cross-host hop.
        self.redirect_host = redirect_host
        # Body bytes after which every response is cut; None serves whole responses.
        self.drop_after: int | None = None
        # Bytes per second to pace responses at (a WAN-like link); None sends as fast as sendfile can.
        self.rate: float | None = None
        self.requests: list[Seen] = []
        self._bytes_sent = 0
        self._sending = 0  # bodies being sent now: their bytes are counted when each send ends
        self._lock = threading.Condition()
        self._key = secrets.token_bytes(16)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("127.0.0.1", port))
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tls_dir: Path | None = None
        self._ssl: ssl.SSLContext | None = None
        if tls:
            self._tls_dir = Path(tempfile.mkdtemp(prefix="fileserver-tls-"))
            self._ssl = _self_signed_context(self._tls_dir)

    @property
    def scheme(self) -> str:
        return "https" if self._ssl is not None else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path | None:
        """The certificate a client must trust to talk to this server over TLS (None without TLS)."""
        return self._tls_dir / "cert.pem" if self._tls_dir is not None else None

    @property
    def bytes_sent(self) -> int:
        """Response body bytes sent since start (or since ``reset_counters``).

        A client can hold the whole body before the server's send has returned and been counted, so this waits
        (up to 5 s) for the bodies being sent to end before it answers."""
        with self._lock:
            self._lock.wait_for(lambda: self._sending == 0, timeout=5)
            return self._bytes_sent

    def reset_counters(self) -> None:
        with self._lock:
            self._bytes_sent = 0
            self.requests.clear()

    def hub_url(self, org: str, repo: str, file: str) -> str:
        return f"{self.url}/{org}/{repo}/resolve/main/{file}"

    def _begin_send(self) -> None:
        with self._lock:
            self._sending += 1

    def _add_sent(self, count: int) -> None:
        """Count what one send put out, and end it."""
        with self._lock:
            self._bytes_sent += count
            self._sending -= 1
            self._lock.notify_all()

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="fileserver", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the file server did not start within 10 s")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=0.5)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, self._sock, ssl_context=self._ssl).start())
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    # -- HTTP ------------------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._observe_and_authorize])
        app.router.add_get("/redirect/{path:.+}", self._redirect)
        app.router.add_get("/{org}/{repo}/resolve/{rev}/{file:.+}", self._resolve)
        app.router.add_get("/{path:.+}", self._plain)
        return app

    def _signature(self, path: str) -> str:
        return hmac.new(self._key, path.encode(), "sha256").hexdigest()

    @web.middleware
    async def _observe_and_authorize(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        auth = request.headers.get("Authorization")
        with self._lock:
            self.requests.append(
                Seen(
                    request.method,
                    request.host.split(":")[0],
                    request.path,
                    auth is not None,
                    request.headers.get("Range"),
                )
            )
        signed = hmac.compare_digest(request.query.get("sig", ""), self._signature(request.path))
        if self.token and not signed and auth != f"Bearer {self.token}":
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": "Bearer"}, text="token required\n")
        return await handler(request)

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["path"]
        location = f"{self.scheme}://{self.redirect_host}:{self.port}{path}?sig={self._signature(path)}"
        raise web.HTTPFound(location)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        return self._file(f"{info['org']}/{info['repo']}/{info['file']}")

    async def _plain(self, request: web.Request) -> web.StreamResponse:
        return self._file(request.match_info["path"])

    def _file(self, relative: str) -> web.StreamResponse:
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            raise web.HTTPNotFound(text=f"no such file: {relative}\n")
        return _CountedFileResponse(path, self)


def _self_signed_context(folder: Path) -> ssl.SSLContext:
    """A server context with a fresh certificate for 127.0.0.1 and localhost, written to ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "v100box lab file server")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return context


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a folder like a model hub (Range, redirects, token).")
    parser.add_argument("root", type=Path)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN'")
    parser.add_argument("--tls", action="store_true", help="serve HTTPS with a throwaway self-signed certificate")
    args = parser.parse_args(argv)
    with FileServer(args.root, token=args.token, port=args.port, tls=args.tls) as server:
        trust = f"; trust {server.ca_file}" if server.ca_file else ""
        print(f"serving {server.root} at {server.url}{trust} (Ctrl-C stops)", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
