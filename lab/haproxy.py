"""HAProxy from Debian 12's packages, for the gateway's tests and benchmark (roles/llm_gateway installs the
distribution's package on a box; the lab fetches the same .debs once and caches them).

``debs()`` is the folder of .deb files a target installs with dpkg; ``unpacked()`` is the haproxy binary
unpacked on this machine with the environment that finds its libraries, for running it without a target.
``render_config()`` renders the role's own template with Ansible, as the role does on a box.
``stalled_clients()`` opens the connections of clients that send part of a request and then nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from lab import localplay
from lab.host import cache_lock, debian_packages

# haproxy and what a Debian 12 minbase system lacks of its dependencies (apt-cache depends haproxy).
DEBS = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")


def debs() -> Path:
    """The folder of the Debian 12 packages, downloaded once into ~/.cache/v100-llm-box/debs/haproxy."""
    return debian_packages("haproxy", DEBS)


def unpacked() -> tuple[Path, dict[str, str]]:
    """The haproxy binary unpacked from the packages, and the environment that finds its libraries."""
    folder = debs()
    root = folder / "root"
    binary = root / "usr" / "sbin" / "haproxy"
    with cache_lock(folder / ".unpack.lock"):  # the suite's workers share the cache: one unpacks, in full
        if not (root / ".unpacked").exists():
            for deb in sorted(folder.glob("*.deb")):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            (root / ".unpacked").touch()
    return binary, {**os.environ, "LD_LIBRARY_PATH": str(root / "usr" / "lib" / "x86_64-linux-gnu")}


def render_config(folder: Path, variables: dict, template: Path | None = None) -> Path:
    """roles/llm_gateway's haproxy.cfg for ``variables`` (llm_gateway_*), its tables in ``folder``.

    ``template``: another version of the role's template (a benchmark's before and after), rendered with the
    role's current defaults and variables.
    """
    role = localplay.ROLES / "llm_gateway"
    task = localplay.template(template or role / "templates" / "haproxy.cfg.j2", folder / "haproxy.cfg",
                              name="Render the gateway configuration")
    localplay.run_play("llm_gateway", [task], {**variables, "_llm_gateway_dir": str(folder)}, folder)
    routes = variables["llm_gateway_routes"]
    prefix = "route_"
    (folder / "routes.map").write_text("".join(f"{r['model']} {prefix}{i}\n" for i, r in enumerate(routes, 1)))
    (folder / "models.json").write_text(json.dumps({"object": "list", "data": [
        {"id": r["model"], "object": "model", "owned_by": r["box"]} for r in routes]}))
    return folder / "haproxy.cfg"


def stalled_clients(port: int, count: int, source: str, data: bytes, *, timeout: float = 5.0) -> list[socket.socket]:
    """``count`` connections to loopback ``port`` from the address ``source`` that send ``data`` (part of a
    request) and then nothing; those the gateway refused or closed as they arrived are not in the list."""
    opened = []
    for _ in range(count):
        sock = socket.socket()
        try:
            sock.bind((source, 0))
            sock.settimeout(timeout)
            sock.connect(("127.0.0.1", port))
            sock.sendall(data)
        except OSError:
            sock.close()
            continue
        opened.append(sock)
    return opened
