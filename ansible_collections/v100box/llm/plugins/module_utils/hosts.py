"""Which host a URL names to reach a server from the box it runs on.

One copy for the whole project: the filter ``v100box.llm.reachable_host`` (roles build health and API URLs with it),
``llama_burn_in`` on the box, and the controller's planner and client settings (``controller.model.rules``) import it
from here. Standard library only, as module_utils that travel to a box must be.
"""

from __future__ import annotations

import ipaddress

# A server bound to one of these listens on every address of its family; it is reached on loopback.
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "[::1]"}


def reachable_host(bind):
    """The host part of a URL that reaches a server bound to ``bind`` from the box itself.

    A wildcard bind is reached on loopback of the same family; an IPv6 address is bracketed (it may come bracketed
    already); a host name stays as it is.
    """
    text = str(bind).strip().strip("[]")
    if text in WILDCARDS:
        return WILDCARDS[text]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    return f"[{address}]" if address.version == 6 else str(address)
