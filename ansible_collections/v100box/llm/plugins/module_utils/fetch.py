"""``open_url`` for the modules that send a server several requests in one run (llama_api_check, box_manifest,
llama_burn_in), on the standard library's ``urllib.request``.

``ansible.module_utils.urls.open_url`` builds a new TLS context for every request, plain HTTP ones included, and
each build loads the system's CA certificates: about 23 ms of CPU on the box a request. A server check sends six
requests (more with certification) and took 0.34 CPU-s on the lab, 0.20 with one context. And a module's payload
carries ``ansible.module_utils.urls`` as source that the box compiles on every run (about 45 ms of CPU, against 14 ms
for ``urllib.request``, ``ssl`` and ``http.cookiejar``, whose bytecode the box's Python keeps). Here a module run
builds one context for each ``validate_certs`` setting, when its first HTTPS request needs it (a run that only
speaks plain HTTP, such as every check of a loopback server, builds none: about 19 ms of CPU on a lab box), and every
request of the run reuses it; the rest is what ``open_url`` does with these arguments: proxies from the environment,
redirects followed (to HTTPS too), an ``HTTPError`` for an answer that is not 2xx, and a cookie jar of its own for
each request.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.request
from http.cookiejar import CookieJar

_CONTEXTS = {}
USER_AGENT = "ansible-httpget"  # what ansible's open_url sends


def tls_context(validate_certs=True):
    """The system's default TLS context (certificates checked against its CA store, or not at all), built once per
    module run."""
    validate_certs = bool(validate_certs)
    if validate_certs not in _CONTEXTS:
        context = ssl.create_default_context()
        if not validate_certs:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        _CONTEXTS[validate_certs] = context
    return _CONTEXTS[validate_certs]


class _HTTPSHandler(urllib.request.AbstractHTTPHandler):
    """HTTPS with the run's context for ``validate_certs``, taken when a request needs it. (urllib's ``HTTPSHandler``
    builds a default context when it is made, from Python 3.12 on: for plain HTTP requests too.)"""

    def __init__(self, validate_certs):
        super().__init__()
        self._validate_certs = validate_certs

    def https_open(self, req):
        return self.do_open(http.client.HTTPSConnection, req, context=tls_context(self._validate_certs))

    https_request = urllib.request.AbstractHTTPHandler.do_request_


# What urllib's build_opener puts in an opener for HTTP, with the HTTPS handler above instead of its own.
_HANDLERS = (urllib.request.ProxyHandler, urllib.request.UnknownHandler, urllib.request.HTTPHandler,
             urllib.request.HTTPDefaultErrorHandler, urllib.request.HTTPRedirectHandler,
             urllib.request.HTTPErrorProcessor)


def open_url(url, data=None, headers=None, method=None, timeout=10, validate_certs=True):
    """The answer to one request (an ``http.client.HTTPResponse``); raises ``urllib.error.HTTPError`` for an answer
    that is not 2xx and ``URLError``/``OSError`` when there is none."""
    request = urllib.request.Request(url, data=data, headers={"User-Agent": USER_AGENT, **(headers or {})},
                                     method=method or ("POST" if data else "GET"))
    opener = urllib.request.OpenerDirector()
    for handler in (*(make() for make in _HANDLERS), _HTTPSHandler(validate_certs),
                    urllib.request.HTTPCookieProcessor(CookieJar())):
        opener.add_handler(handler)
    return opener.open(request, timeout=timeout)
