"""What llama_service opens in firewalld and ufw, as Ansible computes it from the role's own vars: each
allowed network to each port of a server bound beyond loopback (by its --host or llama_service_bind),
with firewalld rich rules of the network's family, and nothing without an exposed server. The rules
themselves are run against ufw, and parsed by firewalld's own parser, in
tests/integration/test_llama_firewall.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "ansible_collections/v100box/llm/roles" / "llama_service"
PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Write the openings
      ansible.builtin.copy:
        content: "{{{{ {{'ufw': _llama_service_ufw_openings, 'firewalld': _llama_service_firewalld_openings}} | to_json }}}}"
        dest: {out}/openings.json
        mode: "0600"
"""


def _openings(tmp_path: Path, bind: str, allow_from: list[str], servers: list[tuple[str | None, int]]) -> dict:
    (tmp_path / "show.yml").write_text(PLAYBOOK.format(out=tmp_path))
    instances = [{"name": f"s{port}", "model": "m", "engine": "cpu", "port": port,
                  "args": ["--port", str(port), *(["--host", host] if host else [])]} for host, port in servers]
    (tmp_path / "vars.yml").write_text(yaml.safe_dump({
        **yaml.safe_load((ROLE / "defaults/main.yml").read_text()),
        **yaml.safe_load((ROLE / "vars/main.yml").read_text()),
        "llama_service_bind": bind, "llama_service_allow_from": allow_from, "llama_service_instances": instances,
        "ansible_python_interpreter": sys.executable}))
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), str(tmp_path / "show.yml"),
                           "-e", f"@{tmp_path / 'vars.yml'}"], env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return json.loads((tmp_path / "openings.json").read_text())


def test_each_allowed_network_gets_each_exposed_port_only(tmp_path):
    got = _openings(tmp_path, "127.0.0.1", ["192.168.1.0/24", "2001:db8::/32", "192.168.1.0/24"],
                    [("0.0.0.0", 8002), (None, 8003), ("127.0.0.1", 8004), ("10.0.0.5", 8001)])
    assert got["ufw"] == [{"source": "192.168.1.0/24", "port": 8001}, {"source": "192.168.1.0/24", "port": 8002},
                          {"source": "2001:db8::/32", "port": 8001}, {"source": "2001:db8::/32", "port": 8002}]
    assert [{"source": o["source"], "port": o["port"]} for o in got["firewalld"]] == got["ufw"]
    assert got["firewalld"][0]["rule"] == ('rule family="ipv4" source address="192.168.1.0/24" port port="8001" '
                                           'protocol="tcp" accept')
    assert got["firewalld"][3]["rule"] == ('rule family="ipv6" source address="2001:db8::/32" port port="8002" '
                                           'protocol="tcp" accept')


def test_bind_beyond_loopback_exposes_every_server(tmp_path):
    got = _openings(tmp_path, "0.0.0.0", ["10.1.0.0/16"], [(None, 8011), ("0.0.0.0", 8012)])
    assert got["ufw"] == [{"source": "10.1.0.0/16", "port": 8011}, {"source": "10.1.0.0/16", "port": 8012}]


def test_nothing_is_opened_without_an_exposed_server(tmp_path):
    got = _openings(tmp_path, "127.0.0.1", ["10.1.0.0/16"], [(None, 8011), ("127.0.0.1", 8012), ("::1", 8013)])
    assert got == {"ufw": [], "firewalld": []}
