"""HAProxy from Debian 12's packages, for the gateway's tests and benchmark (roles/llm_gateway installs the
distribution's package on a box; the lab fetches the same .debs once and caches them).

``debs()`` is the folder of .deb files a target installs with dpkg; ``unpacked()`` is the haproxy binary
unpacked on this machine with the environment that finds its libraries, for running it without a target.
``render_config()`` renders the role's own template with Ansible, as the role does on a box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lab.engine_build import cache_root

ROOT = Path(__file__).resolve().parents[1]
# haproxy and what a Debian 12 minbase system lacks of its dependencies (apt-cache depends haproxy).
DEBS = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")


def debs() -> Path:
    """The folder of the Debian 12 packages, downloaded once into ~/.cache/v100-llm-box/debs/haproxy."""
    folder = cache_root() / "debs" / "haproxy"
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.deb"))) < len(DEBS):
        done = subprocess.run(["apt-get", "download", *DEBS], cwd=folder, capture_output=True, text=True, check=False)
        if done.returncode != 0:  # package lists older than the archive: refresh them once
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False, timeout=300)
            done = subprocess.run(["apt-get", "download", *DEBS], cwd=folder, capture_output=True, text=True,
                                  check=False)
        if done.returncode != 0:
            raise RuntimeError(f"apt-get download {' '.join(DEBS)} failed: {done.stderr.strip()}")
    return folder


def unpacked() -> tuple[Path, dict[str, str]]:
    """The haproxy binary unpacked from the packages, and the environment that finds its libraries."""
    folder = debs()
    root = folder / "root"
    binary = root / "usr" / "sbin" / "haproxy"
    if not binary.exists():
        for deb in sorted(folder.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return binary, {**os.environ, "LD_LIBRARY_PATH": str(root / "usr" / "lib" / "x86_64-linux-gnu")}


_PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  vars_files: [{role}/defaults/main.yml, {role}/vars/main.yml]
  tasks:
    - name: Render the gateway configuration
      ansible.builtin.template:
        src: {template}
        dest: {out}/haproxy.cfg
        mode: "0644"
"""


def render_config(folder: Path, variables: dict, template: Path | None = None) -> Path:
    """roles/llm_gateway's haproxy.cfg for ``variables`` (llm_gateway_*), its tables in ``folder``.

    ``template``: another version of the role's template (a benchmark's before and after), rendered with the
    role's current defaults and variables.
    """
    folder.mkdir(parents=True, exist_ok=True)
    role = ROOT / "ansible_collections/v100box/llm/roles" / "llm_gateway"
    (folder / "play.yml").write_text(_PLAYBOOK.format(role=role, out=folder,
                                                      template=template or role / "templates" / "haproxy.cfg.j2"))
    (folder / "vars.json").write_text(json.dumps({**variables, "_llm_gateway_dir": str(folder),
                                                  "ansible_python_interpreter": sys.executable}))
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,",
                           str(folder / "play.yml"), "-e", f"@{folder / 'vars.json'}"],
                          capture_output=True, text=True, check=False, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"rendering haproxy.cfg failed: {done.stdout[-2000:]}")
    routes = variables["llm_gateway_routes"]
    prefix = "route_"
    (folder / "routes.map").write_text("".join(f"{r['model']} {prefix}{i}\n" for i, r in enumerate(routes, 1)))
    (folder / "models.json").write_text(json.dumps({"object": "list", "data": [
        {"id": r["model"], "object": "model", "owned_by": r["box"]} for r in routes]}))
    return folder / "haproxy.cfg"
