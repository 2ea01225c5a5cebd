"""llama_service's firewall on a real systemd box with its own network: the port of a server bound beyond
loopback answers loopback and llama_service_allow_from, drops everyone else, and the table goes away
with the last exposed server.

The lab's molecule containers share the host's network namespace (their nftables would be the
host's), so this test starts the target image on podman's bridge network instead: the host reaches
it from the bridge's gateway address, a network the test leaves out of allow_from and then adds.
A stand-in listener (python3 -m http.server) takes the server's place: the firewall is under test, not
llama-server. nftables comes from Debian's packages, fetched once on the host like the image's own
packages (cached under ~/.cache/v100-llm-box/debs/nftables) and installed as a stock Debian 12 box
has it (Priority: important); the role's package task then finds it present.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from controller.lab import target as lab_target
from controller.lab.engine_build import cache_root

pytestmark = [pytest.mark.podman, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PORT = 18011
NFT_DEBS = ("nftables", "libnftables1", "libjansson4", "libnftnl11", "libxtables12", "libedit2", "libmnl0",
            "libbsd0", "libmd0", "libgmp10")
PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - name: Apply the role's firewall tasks
      ansible.builtin.include_role:
        name: llama_service
        tasks_from: firewall.yml
"""


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, check=False, timeout=120)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr.strip()}"
    return done


def _nft_debs() -> list[Path]:
    folder = cache_root() / "debs" / "nftables"
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.deb"))) < len(NFT_DEBS):
        done = subprocess.run(["apt-get", "download", *NFT_DEBS], cwd=folder, capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:  # package lists older than the archive: refresh them once
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False, timeout=300)
            done = subprocess.run(["apt-get", "download", *NFT_DEBS], cwd=folder, capture_output=True, text=True,
                                  check=False)
        assert done.returncode == 0, f"apt-get download {' '.join(NFT_DEBS)} failed: {done.stderr.strip()}"
    return sorted(folder.glob("*.deb"))


@pytest.fixture(scope="module")
def box(target_image):
    name = f"v100box-fw-{secrets.token_hex(3)}"
    _podman("run", "--detach", "--name", name, "--hostname", name,
            "--label", f"{lab_target.LABEL}=1", "--label", f"{lab_target.OWNER_LABEL}={lab_target.owner_token()}",
            "--privileged", "--systemd=always", "--network=bridge", target_image, "/sbin/init")
    try:
        debs = _nft_debs()
        _podman("cp", str(debs[0].parent), f"{name}:/root/nftables-debs")
        _podman("exec", name, "sh", "-c", "dpkg --install /root/nftables-debs/*.deb")
        _podman("exec", name, "systemctl", "is-system-running", "--wait", check=False)
        _podman("exec", name, "systemd-run", "--unit", "stand-in-llama", "python3", "-m", "http.server",
                "--bind", "0.0.0.0", str(PORT))
        inspected = json.loads(_podman("inspect", name).stdout)[0]["NetworkSettings"]
        yield name, inspected["IPAddress"], inspected["Gateway"], inspected["IPPrefixLen"]
    finally:
        _podman("rm", "--force", "--time", "2", name, check=False)


def _converge(name: str, tmp_path: Path, **variables: object) -> str:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {name: {
        "ansible_connection": "containers.podman.podman", "ansible_python_interpreter": "/usr/bin/python3"}}}}))
    playbook = tmp_path / "firewall.yml"
    playbook.write_text(PLAYBOOK)
    extra = tmp_path / "vars.yml"
    extra.write_text(yaml.safe_dump(variables))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(ROOT / "roles"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOST_KEY_CHECKING": "False"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), str(playbook),
                           "-e", f"@{extra}"], env=env, capture_output=True, text=True, check=False, timeout=300)
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
