"""``open_url`` for the modules that send a server several requests in one run (llama_api_check, box_manifest,
llama_burn_in).

``ansible.module_utils.urls.open_url`` builds a new TLS context for every request, plain HTTP ones included, and
each build loads the system's CA certificates: about 23 ms of CPU on the box a request. A server check sends six
requests (more with certification) and took 0.34 CPU-s on the lab, 0.20 with one context. Here a module run builds
one context for each ``validate_certs`` setting and every request of the run reuses it; everything else is
``open_url``'s: the same defaults, proxies from the environment, and a cookie jar of its own for each request.
"""

from __future__ import annotations

from ansible.module_utils.urls import Request, make_context

_CONTEXTS = {}


def tls_context(validate_certs=True):
    """The TLS context ``open_url`` would build, built once per module run."""
    validate_certs = bool(validate_certs)
    if validate_certs not in _CONTEXTS:
        _CONTEXTS[validate_certs] = make_context(validate_certs=validate_certs)
    return _CONTEXTS[validate_certs]


def open_url(url, data=None, headers=None, method=None, timeout=10, validate_certs=True):
    """``ansible.module_utils.urls.open_url(url, ...)`` with the run's TLS context."""
    method = method or ("POST" if data else "GET")
    return Request(context=tls_context(validate_certs)).open(method, url, data=data, headers=headers,
                                                             timeout=timeout, validate_certs=validate_certs)
