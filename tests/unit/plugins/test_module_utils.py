"""The collection's module_utils: what llama_api_check and llama_burn_in share about a llama-server's answers, and
what llama_box_state and llama_burn_in share about ``systemctl show``."""

from __future__ import annotations

import io
from urllib.error import HTTPError

from ansible_collections.v100box.llm.plugins.module_utils.hosts import reachable_host
from ansible_collections.v100box.llm.plugins.module_utils.llama_api import (
    error_text,
    http_error_text,
    read_key_file,
    sse_events,
)
from ansible_collections.v100box.llm.plugins.module_utils.systemd import show_properties

OPENAI = (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\r\n\r\n'
          b': a comment line\n'
          b'data: [DONE]\n\n')
ANTHROPIC = (b'event: message_start\ndata: {"type": "message_start"}\n\n'
             b'data: {"type": "ping"}\n\n'
             b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}\n')


def test_server_sent_events_of_both_apis():
    assert list(sse_events(io.BytesIO(OPENAI))) == [("", {"choices": [{"delta": {"content": "Hi"}}]}), ("", "[DONE]")]
    events = list(sse_events(io.BytesIO(ANTHROPIC)))
    assert [name for name, _data in events] == ["message_start", "", "error"]  # a name holds for its own event only
    assert error_text(events[2][1]) == "Overloaded"
    assert list(sse_events(io.BytesIO(b""))) == []


def test_the_error_message_in_each_shape_a_server_sends():
    assert error_text({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}) == \
        "Invalid API Key"
    assert error_text({"error": "Loading model"}) == "Loading model"
    assert error_text({"code": 500, "message": "context full"}) == "context full"
    assert error_text({"error": {"type": "x"}}) == '{"type": "x"}'  # no message: what it did send
    assert error_text({"choices": []}) == error_text("[DONE]") == error_text(None) == ""
    body = io.BytesIO(b'{"error": {"message": "Loading model"}}')
    assert http_error_text(HTTPError("http://x/v1/messages", 503, "Service Unavailable", {}, body)) == "Loading model"
    assert http_error_text(HTTPError("http://x/", 502, "Bad Gateway", {}, io.BytesIO(b"<html>"))) == ""


def test_the_key_is_the_first_line_of_its_file(tmp_path):
    key = tmp_path / "api.key"
    key.write_text("  sk-0123456789abcdef  \nsecond line\n")
    assert read_key_file(key) == "sk-0123456789abcdef"
    key.write_text("")
    assert read_key_file(key) == ""


def test_a_wildcard_bind_is_reached_on_loopback_and_ipv6_is_bracketed():
    assert [reachable_host(bind) for bind in ("", "0.0.0.0", "*", "::", "[::]", "::1", "[fe80::1]", "10.0.0.2",
                                              "box.lan")] == \
        ["127.0.0.1", "127.0.0.1", "127.0.0.1", "[::1]", "[::1]", "[::1]", "[fe80::1]", "10.0.0.2", "box.lan"]


def test_systemctl_show_gives_one_block_per_unit_in_the_order_asked():
    text = "Id=a.service\nExecStart={ path=/bin/x ; argv[]=/bin/x -a=1 }\n\nId=b.service\nMainPID=0\n"
    assert show_properties(text) == [{"Id": "a.service", "ExecStart": "{ path=/bin/x ; argv[]=/bin/x -a=1 }"},
                                     {"Id": "b.service", "MainPID": "0"}]
    assert show_properties("") == [{}]


def test_plain_http_builds_no_tls_context_and_one_serves_every_https_request_of_a_run(tmp_path, monkeypatch):
    # open_url builds a TLS context a request, loading the CA store each time (about 23 ms of the box's CPU); the
    # modules' open_url builds one a run. The shared context verifies as open_url's would: a self-signed server is
    # refused until its certificate is trusted (SSL_CERT_FILE, read when the context is built), and with
    # validate_certs false it is not checked.
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from urllib.error import URLError

    import pytest

    from ansible_collections.v100box.llm.plugins.module_utils import fetch
    from lab.fileserver import FileServer

    (tmp_path / "health").write_text('{"status": "ok"}')
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    monkeypatch.setattr(fetch, "_CONTEXTS", {})
    with FileServer(tmp_path) as plain:  # plain HTTP needs none: a run that only checks loopback servers builds none
        for validate_certs in (True, False):
            with fetch.open_url(plain.url + "/health", timeout=10, validate_certs=validate_certs) as answer:
                assert answer.status == 200
    assert built == [] and fetch._CONTEXTS == {}
    with FileServer(tmp_path, tls=True) as server:
        built.clear()  # the server's own context
        with pytest.raises(URLError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch.open_url(server.url + "/health", timeout=10)
        with fetch.open_url(server.url + "/health", timeout=10, validate_certs=False) as answer:
            assert answer.status == 200
        assert len(built) == 2  # one context for each validate_certs setting, whatever the requests

        monkeypatch.setattr(fetch, "_CONTEXTS", {})
        monkeypatch.setenv("SSL_CERT_FILE", str(server.ca_file))
        for _ in range(3):
            with fetch.open_url(server.url + "/health", timeout=10) as answer:
                assert answer.read() == b'{"status": "ok"}'
        assert len(built) == 3

        # A plain-HTTP URL that redirects to HTTPS is followed there, with that URL's context (verified or not).
        class Redirect(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(302)
                self.send_header("Location", server.url + "/health")
                self.end_headers()

            def log_message(self, *_args):
                pass

        hop = HTTPServer(("127.0.0.1", 0), Redirect)
        threading.Thread(target=hop.serve_forever, daemon=True).start()
        try:
            with fetch.open_url(f"http://127.0.0.1:{hop.server_port}/go", timeout=10) as answer:
                assert answer.url == server.url + "/health" and answer.read() == b'{"status": "ok"}'
        finally:
            hop.shutdown()
            hop.server_close()
