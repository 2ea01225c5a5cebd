"""The lab file server speaks the HTTP that download code relies on: ranges, HEAD, auth, faults, pacing."""

from __future__ import annotations

import asyncio
import http.client
import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.fileserver import FileServer

DATA = os.urandom(3 << 20)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FileServer]:
    (tmp_path / "org" / "repo").mkdir(parents=True)
    (tmp_path / "org" / "repo" / "model.gguf").write_bytes(DATA)
    (tmp_path / "SHA256SUMS").write_text("0" * 64 + "  pack.tar.gz\n")
    with FileServer(tmp_path) as srv:
        yield srv


def _get(
    srv: FileServer, path: str, method: str = "GET", **headers: str
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


def test_hub_layout_serves_ranges(server: FileServer) -> None:
    status, headers, body = _get(server, "/org/repo/resolve/main/model.gguf", Range="bytes=1000-")

    assert status == 206
    assert headers["Content-Range"] == f"bytes 1000-{len(DATA) - 1}/{len(DATA)}"
    assert headers["Accept-Ranges"] == "bytes"
    assert body == DATA[1000:]
    assert server.bytes_sent == len(DATA) - 1000


def test_head_gives_the_size_without_a_body(server: FileServer) -> None:
    status, headers, body = _get(server, "/org/repo/resolve/main/model.gguf", method="HEAD")

    assert (status, int(headers["Content-Length"]), body) == (200, len(DATA), b"")
    assert server.bytes_sent == 0


def test_plain_paths_and_no_escape_from_the_root(server: FileServer) -> None:
    assert _get(server, "/SHA256SUMS")[2].endswith(b"pack.tar.gz\n")
    assert _get(server, "/org/repo/../../../etc/passwd")[0] == 404
    assert _get(server, "/org/repo/resolve/main/missing.gguf")[0] == 404


def test_redirect_points_at_another_host_with_a_signed_url(server: FileServer) -> None:
    server.token = "secret"
    status, headers, _ = _get(
        server, "/redirect/org/repo/resolve/main/model.gguf", Authorization="Bearer secret"
    )
    location = headers["Location"]

    assert status == 302
    assert location.startswith(f"http://localhost:{server.port}/org/repo/resolve/main/model.gguf?sig=")
    assert _get(server, location.split(str(server.port), 1)[1])[0] == 200  # no token needed
    assert _get(server, "/org/repo/resolve/main/model.gguf?sig=forged")[0] == 401


def test_token_is_enforced(server: FileServer) -> None:
    server.token = "secret"

    assert _get(server, "/SHA256SUMS")[0] == 401
    assert _get(server, "/SHA256SUMS", Authorization="Bearer wrong")[0] == 401
    assert _get(server, "/SHA256SUMS", Authorization="Bearer secret")[0] == 200


def test_drop_after_cuts_the_body_and_counts_what_went_out(server: FileServer) -> None:
    server.drop_after = 1 << 20
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/org/repo/resolve/main/model.gguf")

    with pytest.raises(http.client.IncompleteRead) as cut:
        connection.getresponse().read()

    assert len(cut.value.partial) == 1 << 20
    assert server.bytes_sent == 1 << 20


def test_rate_paces_the_response(server: FileServer) -> None:
    server.rate = 8 << 20  # 3 MiB at 8 MiB/s: at least 0.375 s

    started = time.perf_counter()
    body = _get(server, "/org/repo/resolve/main/model.gguf")[2]

    assert body == DATA
    assert time.perf_counter() - started >= 0.35


def test_tls_serves_ranges_to_a_client_trusting_its_certificate(tmp_path: Path) -> None:
    (tmp_path / "org" / "repo").mkdir(parents=True)
    (tmp_path / "org" / "repo" / "model.gguf").write_bytes(DATA)
    with FileServer(tmp_path, tls=True) as srv:
        assert srv.url.startswith("https://127.0.0.1:") and srv.ca_file is not None
        context = ssl.create_default_context(cafile=str(srv.ca_file))
        connection = http.client.HTTPSConnection("127.0.0.1", srv.port, timeout=10, context=context)
        connection.request("GET", "/org/repo/resolve/main/model.gguf", headers={"Range": "bytes=10-"})
        response = connection.getresponse()
        assert (response.status, response.read()) == (206, DATA[10:])
        connection.request("GET", "/redirect/org/repo/resolve/main/model.gguf")
        redirect = connection.getresponse()
        redirect.read()
        assert redirect.headers["Location"].startswith(f"https://localhost:{srv.port}/")
        with pytest.raises(ssl.SSLCertVerificationError):  # a client without the certificate refuses it
            untrusting = http.client.HTTPSConnection("127.0.0.1", srv.port, timeout=10,
                                                     context=ssl.create_default_context())
            untrusting.request("GET", "/org/repo/resolve/main/model.gguf")
        ca_file = srv.ca_file
    assert not ca_file.exists()


def test_the_count_includes_a_body_the_client_already_holds(server: FileServer, monkeypatch) -> None:
    """The client can read the whole body before the server's send returns and is counted: the count waits for it."""
    from aiohttp import web

    original = web.FileResponse._sendfile

    async def slow_to_return(self, request, fobj, offset, count):
        writer = await original(self, request, fobj, offset, count)
        await asyncio.sleep(0.5)  # the body is out; the server has not counted it yet
        return writer

    monkeypatch.setattr(web.FileResponse, "_sendfile", slow_to_return)
    status, _, body = _get(server, "/org/repo/resolve/main/model.gguf")
    assert (status, len(body)) == (200, len(DATA))
    assert server.bytes_sent == len(DATA)
