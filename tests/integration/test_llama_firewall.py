"""llama_service's firewall on a real systemd box with its own network: the port of a server bound beyond
loopback answers loopback and llama_service_allow_from, drops everyone else, and the table goes away
with the last exposed server. With ufw active and denying incoming connections, the role's ufw rules
let in the allowed networks only, and go away again with the network or the server.

The lab's molecule containers share the host's network namespace (their nftables would be the
host's), so this test starts the target image on podman's bridge network instead: the host reaches
it from the bridge's gateway address, a network the test leaves out of allow_from and then adds.
A stand-in listener (python3 -m http.server) takes the server's place: the firewall is under test, not
llama-server. nftables comes from Debian's packages, fetched once on the host like the image's own
packages (cached under ~/.cache/v100-llm-box/debs/nftables) and installed as a stock Debian 12 box
has it (Priority: important); the role's package task then finds it present. ufw (and iptables, which
it drives through nf_tables) is installed the same way into the same box, enabled only by the ufw test.
firewalld needs dbus and polkit and is not installed: its rich rules are checked with firewalld's own
parser (python3-firewall, unpacked on the host), the rule lists by tests/unit/test_llama_firewall_rules.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from controller.stages import strategy
from lab import image as lab_image
from lab import target as lab_target
from lab.host import debian_packages

pytestmark = [pytest.mark.podman, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PORT = 18011
NFT_DEBS = ("nftables", "libnftables1", "libjansson4", "libnftnl11", "libxtables12", "libedit2", "libmnl0",
            "libbsd0", "libmd0", "libgmp10")
# ufw and what Debian 12's minbase target lacks of its dependencies (apt-cache depends ufw iptables).
UFW_DEBS = ("ufw", "iptables", "libip4tc2", "libip6tc2", "libnetfilter-conntrack3", "libnfnetlink0", "netbase")
UFW_COMMENT = "v100-llm-box:llama_service"
STATE_FILE = "/etc/llama/firewall-opened.json"
PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - name: Apply the role's firewall tasks
      ansible.builtin.include_role:
        name: v100box.llm.llama_service
        tasks_from: linux-firewall.yml
"""


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, check=False, timeout=120)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr.strip()}"
    return done


def _debs(group: str, names: tuple[str, ...]) -> list[Path]:
    """Debian 12 packages, downloaded once on the host into ~/.cache/v100-llm-box/debs/<group>."""
    return sorted(debian_packages(group, names).glob("*.deb"))


@pytest.fixture(scope="module")
def box(target_image):
    name = f"v100box-fw-{secrets.token_hex(3)}"
    _podman("run", "--detach", "--name", name, "--hostname", name,
            "--label", f"{lab_image.LABEL}=1", "--label", f"{lab_target.OWNER_LABEL}={lab_target.owner_token()}",
            "--privileged", "--systemd=always", "--network=bridge", target_image, "/sbin/init")
    try:
        for group, names in (("nftables", NFT_DEBS), ("ufw", UFW_DEBS)):
            debs = _debs(group, names)
            _podman("cp", str(debs[0].parent), f"{name}:/root/{group}-debs")
            _podman("exec", "--env", "DEBIAN_FRONTEND=noninteractive", name, "sh", "-c",
                    f"dpkg --install /root/{group}-debs/*.deb")
        _podman("exec", name, "systemctl", "is-system-running", "--wait", check=False)
        _podman("exec", name, "systemd-run", "--unit", "stand-in-llama", "python3", "-m", "http.server",
                "--bind", "0.0.0.0", str(PORT))
        inspected = json.loads(_podman("inspect", name).stdout)[0]["NetworkSettings"]
        yield name, inspected["IPAddress"], inspected["Gateway"], inspected["IPPrefixLen"]
    finally:
        _podman("rm", "--force", "--time", "2", name, check=False)


def _converge(name: str, tmp_path: Path, *, check_mode: bool = False, **variables: object) -> str:
    inventory = tmp_path / "hosts.yml"
    # Under mitogen's strategy, as the molecule scenarios run the roles (controller/stages/strategy.py): one Python in the box
    # for the whole play instead of a `podman exec` or `podman cp` or more a task. Its podman connection takes the
    # plugin's short name.
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {name: {
        "ansible_connection": "podman", "ansible_python_interpreter": "/usr/bin/python3"}}}}))
    playbook = tmp_path / "firewall.yml"
    playbook.write_text(PLAYBOOK)
    extra = tmp_path / "vars.yml"
    extra.write_text(yaml.safe_dump(variables))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOST_KEY_CHECKING": "False", **strategy.environment(strategy.MITOGEN)}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), str(playbook),
                           "-e", f"@{extra}", *(["--check"] if check_mode else [])], env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


def _changed(output: str) -> int:
    recap = output[output.rindex("PLAY RECAP"):]
    return int(recap.split("changed=")[1].split()[0])


def _reaches(address: str, port: int) -> bool:
    """Whether a TCP connection from the host gets through; a dropped SYN times out."""
    try:
        with socket.create_connection((address, port), timeout=3):
            return True
    except TimeoutError:
        return False


def _wait_until_listening(address: str, port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection((address, port), timeout=3):
                return
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, f"nothing listens on {address}:{port} in the box"
            time.sleep(0.5)


def _instances(host: str) -> list[dict[str, object]]:
    return [{"name": "llama-fw", "model": "tiny", "engine": "cpu", "port": PORT,
             "args": ["--model", "/m.gguf", "--host", host, "--port", str(PORT)]}]


def test_exposed_port_is_limited_to_allowed_networks_and_closed_again(box, tmp_path):
    name, address, gateway, prefix = box
    _wait_until_listening(address, PORT)  # before any firewall exists

    # The host's bridge address is not allowed: its connection is dropped, loopback still answers.
    first = _converge(name, tmp_path, llama_service_bind="0.0.0.0", llama_service_instances=_instances("0.0.0.0"),
                      llama_service_allow_from=["192.0.2.0/24", "2001:db8::/32"])
    table = _podman("exec", name, "nft", "list", "table", "inet", "llama_service").stdout
    assert f"tcp dport {PORT} ip saddr @allowed_ipv4 accept" in table
    assert "192.0.2.0/24" in table and "2001:db8::/32" in table
    assert not _reaches(address, PORT), f"{gateway} is not in allow_from, yet reached port {PORT}"
    loopback = _podman("exec", name, "curl", "--silent", "--max-time", "5", "--output", "/dev/null",
                       "--write-out", "%{http_code}", f"http://127.0.0.1:{PORT}/", check=False)
    assert loopback.stdout == "200"
    assert "changed=0" not in first[first.rindex("PLAY RECAP"):]
    # A converged rerun changes nothing.
    again = _converge(name, tmp_path, llama_service_bind="0.0.0.0", llama_service_instances=_instances("0.0.0.0"),
                      llama_service_allow_from=["192.0.2.0/24", "2001:db8::/32"])
    assert _changed(again) == 0, again[-3000:]

    # Allowing the bridge's network lets the host in (a reload, never a window without the table).
    bridge = str(ipaddress.ip_network(f"{gateway}/{prefix}", strict=False))
    _converge(name, tmp_path, llama_service_bind="0.0.0.0", llama_service_instances=_instances("0.0.0.0"), llama_service_allow_from=[bridge])
    assert _reaches(address, PORT)

    # Back on loopback: no exposed server, so no table, no rules file, no unit.
    _converge(name, tmp_path, llama_service_bind="127.0.0.1", llama_service_instances=_instances("127.0.0.1"), llama_service_allow_from=[bridge])
    gone = _podman("exec", name, "nft", "list", "table", "inet", "llama_service", check=False)
    assert gone.returncode != 0, gone.stdout
    leftovers = _podman("exec", name, "ls", "/etc/nftables.d/llama_service.nft",
                        "/etc/systemd/system/llama-service-firewall.service", check=False)
    assert leftovers.returncode != 0, leftovers.stdout
    assert _reaches(address, PORT)
    closed = _converge(name, tmp_path, llama_service_bind="127.0.0.1", llama_service_instances=_instances("127.0.0.1"), llama_service_allow_from=[])
    assert _changed(closed) == 0, closed[-3000:]


def _ufw_rules(name: str) -> list[str]:
    """The lines of `ufw status` that carry the role's comment."""
    status = _podman("exec", name, "ufw", "status").stdout
    assert "Status: active" in status, status
    return [line for line in status.splitlines() if UFW_COMMENT in line]


def _recorded(name: str) -> dict[str, list[dict[str, object]]] | None:
    found = _podman("exec", name, "stat", "--format", "%U %a", STATE_FILE, check=False)
    if found.returncode != 0:
        return None
    assert found.stdout.split() == ["root", "600"], found.stdout
    return json.loads(_podman("exec", name, "cat", STATE_FILE).stdout)


def test_ufw_lets_in_the_allowed_networks_only_and_closes_again(box, tmp_path):
    """Runs after the nftables test, which leaves the box with no table: ufw alone decides here."""
    name, address, gateway, prefix = box
    bridge = str(ipaddress.ip_network(f"{gateway}/{prefix}", strict=False))
    exposed = {"llama_service_bind": "0.0.0.0", "llama_service_instances": _instances("0.0.0.0")}
    assert _podman("exec", name, "nft", "list", "table", "inet", "llama_service", check=False).returncode != 0
    _wait_until_listening(address, PORT)
    _podman("exec", name, "ufw", "default", "deny", "incoming")
    _podman("exec", name, "ufw", "--force", "enable")
    assert "deny (incoming)" in _podman("exec", name, "ufw", "status", "verbose").stdout
    # ufw's own default deny blocks the host: what lets it in below is the role's rule.
    assert not _reaches(address, PORT), "ufw denies incoming connections, yet the host reached the port"

    # Check mode from scratch changes nothing on the box.
    _converge(name, tmp_path, check_mode=True, **exposed, llama_service_allow_from=[bridge, "2001:db8::/32"])
    assert _ufw_rules(name) == [] and _recorded(name) is None

    first = _converge(name, tmp_path, **exposed, llama_service_allow_from=[bridge, "2001:db8::/32"])
    assert _changed(first) > 0
    rules = _ufw_rules(name)
    assert len(rules) == 2, rules
    assert any(line.split()[:3] == [f"{PORT}/tcp", "ALLOW", bridge] for line in rules), rules
    assert any(line.split()[:3] == [f"{PORT}/tcp", "ALLOW", "2001:db8::/32"] for line in rules), rules
    # Opened to the allowed networks only: no rule lets anyone else in on the port.
    everyone = [line for line in _podman("exec", name, "ufw", "status").stdout.splitlines()
                if line.startswith(f"{PORT}") and "Anywhere" in line]
    assert everyone == [], everyone
    assert _recorded(name) == {"firewalld": [], "ufw": [{"source": bridge, "port": PORT},
                                                        {"source": "2001:db8::/32", "port": PORT}]}
    assert _reaches(address, PORT), f"{bridge} is allowed, yet ufw kept the host out"
    # Converged: a rerun and a check-mode rerun change nothing.
    assert _changed(_converge(name, tmp_path, **exposed, llama_service_allow_from=[bridge, "2001:db8::/32"])) == 0
    assert _changed(_converge(name, tmp_path, check_mode=True, **exposed,
                              llama_service_allow_from=[bridge, "2001:db8::/32"])) == 0

    # A network taken out of allow_from loses its rule, and the host its access.
    _converge(name, tmp_path, **exposed, llama_service_allow_from=["192.0.2.0/24"])
    rules = _ufw_rules(name)
    assert [line.split()[:3] for line in rules] == [[f"{PORT}/tcp", "ALLOW", "192.0.2.0/24"]], rules
    assert _recorded(name) == {"firewalld": [], "ufw": [{"source": "192.0.2.0/24", "port": PORT}]}
    assert not _reaches(address, PORT)

    # No exposed server: every rule the role opened and its record are gone; ufw itself stays as it was.
    _converge(name, tmp_path, llama_service_bind="127.0.0.1", llama_service_instances=_instances("127.0.0.1"),
              llama_service_allow_from=["192.0.2.0/24"])
    assert _ufw_rules(name) == [] and _recorded(name) is None
    assert not _reaches(address, PORT)
    again = _converge(name, tmp_path, llama_service_bind="127.0.0.1", llama_service_instances=_instances("127.0.0.1"),
                      llama_service_allow_from=["192.0.2.0/24"])
    assert _changed(again) == 0, again[-3000:]


def test_firewalld_rich_rules_are_canonical():
    """firewalld itself is not run (it needs dbus and polkit in the box): its own rule parser, from Debian's
    python3-firewall, reads each rich rule the role would add back to the same text, so the module's
    query finds a rule the role added (converged reruns change nothing) and the record removes it."""
    folder = _debs("firewalld", ("python3-firewall",))[0].parent
    unpacked = folder / "unpacked"
    if not (unpacked / "usr/lib/python3/dist-packages/firewall").is_dir():
        subprocess.run(["dpkg-deb", "--extract", str(next(folder.glob("*.deb"))), str(unpacked)], check=True)
    rules = _firewalld_openings(["192.168.1.0/24", "2001:db8::/32"], [("0.0.0.0", 8001), ("127.0.0.1", 8002)])
    assert [(rule["source"], rule["port"]) for rule in rules] == [("192.168.1.0/24", 8001), ("2001:db8::/32", 8001)]
    check = ("import json, sys\nfrom firewall.core.rich import Rich_Rule\n"
             "for rule in json.load(sys.stdin):\n    assert str(Rich_Rule(rule_str=rule)) == rule, rule\n"
             "    assert Rich_Rule(rule_str=rule).action is not None\n")
    done = subprocess.run(["python3", "-c", check], input=json.dumps([rule["rule"] for rule in rules]), text=True,
                          capture_output=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(unpacked / "usr/lib/python3/dist-packages")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'family="ipv6" source address="2001:db8::/32"' in rules[1]["rule"]


def _firewalld_openings(allow_from: list[str], servers: list[tuple[str, int]]) -> list[dict[str, object]]:
    """The role's firewalld openings for these networks and (host, port) servers, as Ansible computes them."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        role = ROOT / "ansible_collections/v100box/llm/roles" / "llama_service"
        (out / "show.yml").write_text(
            "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
            "    - ansible.builtin.copy:\n        content: '{{ _llama_service_firewalld_openings | to_json }}'\n"
            f"        dest: {out}/openings.json\n        mode: '0600'\n")
        (out / "vars.yml").write_text(yaml.safe_dump({
            **yaml.safe_load((role / "defaults/main.yml").read_text()),
            **yaml.safe_load((role / "vars/main.yml").read_text()),
            "llama_service_allow_from": allow_from, "ansible_python_interpreter": sys.executable,
            "llama_service_instances": [{"name": f"s{port}", "model": "m", "engine": "cpu", "port": port,
                                         "args": ["--host", host, "--port", str(port)]} for host, port in servers]}))
        done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), str(out / "show.yml"),
                               "-e", f"@{out / 'vars.yml'}"], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout[-3000:]
        return json.loads((out / "openings.json").read_text())
