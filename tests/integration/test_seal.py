"""`controller seal` on a real certified box (SSH into a systemd container, the CPU engine, the tiny model): the
builder's SSH key refused and the buyer's accepted (real ssh), the server answering the new key from the buyer's
copy and refusing the old one (through its port on the host), the first-boot note, machine id, unit and cleared
history on the box (read with podman exec), the unit really making new host keys, a second seal doing nothing,
and an uncertified box refused in one line."""

from __future__ import annotations

import hashlib
import json
import re
import stat
import subprocess
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import yaml

from lab.fileserver import FileServer
from lab.target import free_port
from tests.cli import run_controller
from tests.unit.clean_errors import assert_one_line_error

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

controller = partial(run_controller, timeout=600)
SERVICE = "llama-tiny-llama"
OLD_KEY = "seal-test-builder-key-0123456789abcdef"
MARKER = "v100box-builder-was-here"


@pytest.fixture(scope="module")
def sealed(tmp_path_factory, lab_site, systemd_target):
    """lab1 provisioned, certified and sealed once (lab2 never certified); the seal's --json answer and paths."""
    root, catalog = lab_site
    folder = tmp_path_factory.mktemp("seal")
    buyer_key = folder / "buyer_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "buyer@test", "-f", str(buyer_key)],
                   check=True)
    (folder / "api.key").write_text(OLD_KEY + "\n")
    with FileServer(root) as server:
        box = {"address": systemd_target.host, "port": systemd_target.ssh_port, "user": "root",
               "key": str(systemd_target.key), "models": [{"id": "tiny-llama", "agents": ["claude-code"]}],
               "api_key": {"file": str(folder / "api.key")},
               "mirror": {"engines": f"{server.url}/engines", "models": server.url}}
        fleet = {"catalogs": [str(catalog)], "boxes": {
            "lab1": {**box, "base_port": free_port(),
                     "seal": {"buyer_authorized_keys": [buyer_key.with_suffix(".pub").read_text().strip()]}},
            "lab2": {**box, "port": free_port(), "base_port": free_port()},  # never certified
        }}
        path = folder / "fleet.yml"
        path.write_text(yaml.safe_dump(fleet))
        done = controller("provision", "lab1", "--fleet", str(path), "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    certified = controller("certify", "lab1", "--fleet", str(path), "--json")
    assert certified.returncode == 0, certified.stdout[-3000:] + certified.stderr[-3000:]
    # What the builder leaves behind: a shell history and journal entries of the provisioning.
    systemd_target.exec(f"echo 'curl -H \"x-api-key: {OLD_KEY}\" ...' > /root/.bash_history")
    systemd_target.exec(f"logger -t {MARKER} provisioning && journalctl --flush")
    host_key = systemd_target.exec("cat /etc/ssh/ssh_host_ed25519_key.pub")
    # Ansible's SSH master for the box (ControlPersist, its ControlPath is a hash of host, port and user): the
    # provisioning left it open; the seal must close it.
    digest = hashlib.sha1(f"{systemd_target.host}-{systemd_target.ssh_port}-root".encode()).hexdigest()[:10]
    master = Path.home() / ".ansible" / "cp" / digest
    master_before = master.exists()
    done = controller("seal", "lab1", "--fleet", str(path), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    master_after = master.exists()
    yield {"answer": json.loads(done.stdout.strip().splitlines()[-1]), "fleet": path, "folder": folder,
           "buyer_key": buyer_key, "port": fleet["boxes"]["lab1"]["base_port"], "host_key": host_key,
           "master": (master_before, master_after)}


def new_key(sealed) -> str:
    text = Path(sealed["answer"]["buyer_report"]["markdown"]).read_text()
    (key,) = re.findall(r"^\| \S+ \| `([A-Za-z0-9_-]{40,})` \|$", text, flags=re.M)
    return key


def ssh(target, key: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-i", str(key), "-p", str(target.ssh_port), "-o", "BatchMode=yes",
                           "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10",
                           f"root@{target.host}", "echo", "in"], capture_output=True, text=True, timeout=30,
                          check=False)


def chat_status(port: int, key: str) -> int:
    body = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_builders_ssh_key_is_refused_and_the_buyers_opens_the_box(sealed, systemd_target):
    builder = ssh(systemd_target, systemd_target.key)
    assert builder.returncode == 255 and "Permission denied" in builder.stderr, builder
    buyer = ssh(systemd_target, sealed["buyer_key"])
    assert buyer.returncode == 0 and buyer.stdout.strip() == "in", buyer
    assert sealed["master"] == (True, False)  # Ansible's open connection closed: nothing reuses the builder's login


def test_the_server_answers_the_buyers_new_key_and_refuses_the_old_one(sealed, systemd_target):
    key = new_key(sealed)
    assert chat_status(sealed["port"], key) == 200
    assert chat_status(sealed["port"], OLD_KEY) == 401
    # the box's own account got the new key (its launch script reads this copy)
    assert systemd_target.exec(f"cat /root/.config/v100-llm-box/keys/{SERVICE}.key").strip() == key


def test_the_report_records_the_seal_and_only_the_buyers_copy_holds_the_key(sealed):
    answer, key = sealed["answer"], new_key(sealed)
    assert answer["box"] == "lab1" and answer["sealed"] is True and answer["already"] is False
    changed = " ".join(answer["changed"])
    for words in ("rotated the API key of llama-tiny-llama", "removed shell history: /root/.bash_history",
                  "v100box-first-boot.service", "gave the accounts on the box the new keys",
                  "removed Ansible's traces: /root/.ansible",
                  "replaced the authorized SSH keys of root with the buyer's 1 key"):
        assert words in changed, answer["changed"]
    report = json.loads(Path(answer["reports"]["json"]).read_text())
    assert report["seal"] == {"sealed_at": answer["sealed_at"], "changed": answer["changed"]}
    assert "Seal" in Path(answer["reports"]["markdown"]).read_text()
    inventory = sealed["folder"] / "inventory"
    for path in [*inventory.rglob("*"), sealed["fleet"]]:
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    for path in map(Path, answer["buyer_report"].values()):
        assert path.parent == sealed["folder"] / "buyer" and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert key in path.read_text()


def test_the_box_is_ready_for_its_first_boot(sealed, systemd_target):
    url = f"http://127.0.0.1:{sealed['port']}"
    motd = systemd_target.exec("cat /etc/motd")
    assert "tiny-llama" in motd and url in motd and "/root/FIRST-BOOT.md" in motd
    note = systemd_target.exec("cat /root/FIRST-BOOT.md")
    for words in (url, "Claude Code", "OpenClaw", "v100-lab1/tiny-llama", "ANTHROPIC_BASE_URL",
                  f"/etc/llama/keys/{SERVICE}.key", "claude-tiny-llama"):
        assert words in note, words
    assert new_key(sealed) not in note + motd
    assert systemd_target.exec("cat /etc/machine-id").strip() == "uninitialized"
    assert systemd_target.exec("systemctl is-enabled v100box-first-boot.service").strip() == "enabled"
    assert systemd_target.run("test -e /root/.bash_history").returncode == 1
    assert systemd_target.run("test -e /root/.ansible").returncode == 1
    assert MARKER not in systemd_target.exec(f"journalctl -t {MARKER} --no-pager -q")
    # the host keys stay while the box is up; the unit makes new ones once, then its marker is gone
    assert systemd_target.exec("cat /etc/ssh/ssh_host_ed25519_key.pub") == sealed["host_key"]
    systemd_target.exec("systemctl start v100box-first-boot.service")
    assert systemd_target.exec("cat /etc/ssh/ssh_host_ed25519_key.pub") != sealed["host_key"]
    assert systemd_target.run("test -e /etc/v100box/first-boot").returncode == 1


def test_sealing_again_does_nothing_and_an_uncertified_box_is_refused(sealed):
    again = controller("seal", "lab1", "--fleet", str(sealed["fleet"]))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"lab1: already sealed at {sealed['answer']['sealed_at']}; nothing to do" in again.stdout
    as_json = json.loads(controller("seal", "lab1", "--fleet", str(sealed["fleet"]), "--json").stdout)
    assert as_json["already"] is True and as_json["buyer_report"] is None
    refused = controller("seal", "lab2", "--fleet", str(sealed["fleet"]))
    assert_one_line_error(refused, 10, "lab2", f"controller certify lab2 --fleet {sealed['fleet']}")
