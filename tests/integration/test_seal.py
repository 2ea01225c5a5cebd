"""`controller seal` on a real certified box (SSH into a systemd container, the CPU engine, the tiny model), built
the way a builder does: connecting as its own account with a NOPASSWD sudo rule and a password, its key also in
root's and another account's authorized_keys. After the seal: only the buyer's key opens root and the buyer account
(which may sudo), the builder's account and sudo rule are gone, every other account's keys and passwords too (real
ssh, and every authorized_keys file on the box); the server answers the new key from the buyer's copy and refuses
the old one (through its port on the host); the journal files themselves no longer hold what was logged before
the seal (every journal folder read with `journalctl -D`, and the raw files grepped); the first-boot note, machine
id, unit and cleared history on the box (read with podman exec), the unit really making new host keys and removing
the old machine id's journal; `controller status` and `controller clients` saying the box was handed over; a
second seal doing nothing, and an uncertified box refused in one line."""

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
BUILDER = "builder"  # the account the builder connects as, with a NOPASSWD sudo rule
OTHER = "ops"  # another account the builder's key and a password were left in
BUYER = "owner"  # the account the fleet leaves to the buyer
JOURNALS = "/var/log/journal /run/log/journal"


def build_like_a_builder(target, public_key: str) -> None:
    """The builder's account with its sudo rule, and its key and passwords spread over root and another account."""
    script = [f"useradd -m -s /bin/bash {BUILDER}", f"useradd -m -s /bin/bash {OTHER}",
              f"echo '{BUILDER} ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/90-{BUILDER}",
              f"chmod 0440 /etc/sudoers.d/90-{BUILDER}",
              f"printf 'root:root-pw-1\\n{BUILDER}:builder-pw-1\\n{OTHER}:ops-pw-1\\n' | chpasswd"]
    for account in (BUILDER, OTHER):
        script += [f"install -d -m 0700 -o {account} -g {account} /home/{account}/.ssh",
                   f"echo '{public_key}' > /home/{account}/.ssh/authorized_keys",
                   f"chown {account}: /home/{account}/.ssh/authorized_keys"]
    script.append(f"echo '{public_key}' > /root/.ssh/authorized_keys2")
    target.exec(" && ".join(script))


def journal_text(target) -> str:
    """Everything every journal folder's files hold, each folder read by name, and the raw files' bytes."""
    folders = target.exec(f"find {JOURNALS} -mindepth 1 -maxdepth 1 -type d 2>/dev/null || true").split()
    assert folders, "no journal folder to read"
    read = [target.exec(f"journalctl --directory {folder} --no-pager -q -o verbose || true") for folder in folders]
    raw = target.exec(f"find {JOURNALS} -type f -name '*.journal*' -exec cat {{}} + 2>/dev/null | tr -c '[:print:]' ' '")
    return "\n".join(read) + raw


@pytest.fixture(scope="module")
def sealed(tmp_path_factory, lab_site, systemd_target):
    """lab1 provisioned, certified and sealed once (lab2 never certified); the seal's --json answer and paths."""
    root, catalog = lab_site
    # The seal needs a passed certification, not a fast one: on a busy CI machine the lab's demo band (10 tok/s on
    # the CPU engine) can fail for want of CPU. A copy of the catalog beside it (its paths stay valid) asks for 1.
    models = yaml.safe_load(catalog.read_text())
    for entry in models["models"].values():
        entry["throughput"] = [{**band, "gen_tok_s": [1, None]} for band in entry.get("throughput") or []]
    catalog = catalog.with_name("catalog-seal.yml")
    catalog.write_text(yaml.safe_dump(models, sort_keys=True))
    folder = tmp_path_factory.mktemp("seal")
    buyer_key = folder / "buyer_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "buyer@test", "-f", str(buyer_key)],
                   check=True)
    (folder / "api.key").write_text(OLD_KEY + "\n")
    build_like_a_builder(systemd_target, systemd_target.key.with_suffix(".pub").read_text().strip())
    with FileServer(root) as server:
        box = {"address": systemd_target.host, "port": systemd_target.ssh_port, "user": BUILDER,
               "key": str(systemd_target.key), "models": [{"id": "tiny-llama", "agents": ["claude-code"]}],
               "api_key": {"file": str(folder / "api.key")},
               "mirror": {"engines": f"{server.url}/engines", "models": server.url}}
        fleet = {"catalogs": [str(catalog)], "boxes": {
            "lab1": {**box, "base_port": free_port(),
                     "seal": {"buyer_authorized_keys": [buyer_key.with_suffix(".pub").read_text().strip()],
                              "buyer_account": BUYER, "buyer_sudo": True}},
            "lab2": {**box, "port": free_port(), "base_port": free_port()},  # never certified
        }}
        path = folder / "fleet.yml"
        path.write_text(yaml.safe_dump(fleet))
        done = controller("provision", "lab1", "--fleet", str(path), "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    certified = controller("certify", "lab1", "--fleet", str(path), "--json")
    assert certified.returncode == 0, certified.stdout[-3000:] + certified.stderr[-3000:]
    # What the builder leaves behind: a shell history and journal entries of the provisioning, one with the old key.
    systemd_target.exec(f"echo 'curl -H \"x-api-key: {OLD_KEY}\" ...' > /root/.bash_history")
    systemd_target.exec(f"logger -t {MARKER} 'provisioning with x-api-key {OLD_KEY}' && journalctl --flush")
    journal_before = journal_text(systemd_target)
    host_key = systemd_target.exec("cat /etc/ssh/ssh_host_ed25519_key.pub")
    # Ansible's SSH master for the box (ControlPersist, its ControlPath is a hash of host, port and user): the
    # provisioning left it open; the seal must close it.
    digest = hashlib.sha1(f"{systemd_target.host}-{systemd_target.ssh_port}-{BUILDER}".encode()).hexdigest()[:10]
    master = Path.home() / ".ansible" / "cp" / digest
    master_before = master.exists()
    done = controller("seal", "lab1", "--fleet", str(path), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    master_after = master.exists()
    yield {"answer": json.loads(done.stdout.strip().splitlines()[-1]), "fleet": path, "folder": folder,
           "buyer_key": buyer_key, "port": fleet["boxes"]["lab1"]["base_port"], "host_key": host_key,
           "master": (master_before, master_after), "journal_before": journal_before}


def new_key(sealed) -> str:
    text = Path(sealed["answer"]["buyer_report"]["markdown"]).read_text()
    (key,) = re.findall(r"^\| \S+ \| `([A-Za-z0-9_-]{40,})` \|$", text, flags=re.M)
    return key


def ssh(target, key: Path, user: str = "root", *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-i", str(key), "-p", str(target.ssh_port), "-o", "BatchMode=yes",
                           "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10",
                           f"{user}@{target.host}", *(command or ("echo", "in"))], capture_output=True, text=True,
                          timeout=30, check=False)


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
    for user in ("root", BUILDER, OTHER, BUYER):
        builder = ssh(systemd_target, systemd_target.key, user)
        assert builder.returncode == 255 and "Permission denied" in builder.stderr, (user, builder)
    for user in ("root", BUYER):
        buyer = ssh(systemd_target, sealed["buyer_key"], user)
        assert buyer.returncode == 0 and buyer.stdout.strip() == "in", (user, buyer)
    as_root = ssh(systemd_target, sealed["buyer_key"], BUYER, "sudo", "-n", "id", "-u")
    assert as_root.returncode == 0 and as_root.stdout.strip() == "0", as_root  # what the fleet named: sudo
    assert sealed["master"] == (True, False)  # Ansible's open connection closed: nothing reuses the builder's login


def test_only_the_buyers_keys_are_left_and_the_builders_account_sudo_and_passwords_are_gone(sealed, systemd_target):
    buyer_key = sealed["buyer_key"].with_suffix(".pub").read_text().strip()
    found = systemd_target.exec("find / -xdev \\( -name authorized_keys -o -name authorized_keys2 \\) "
                                "\\( -type f -o -type l \\) 2>/dev/null || true")
    assert sorted(found.split()) == ["/home/owner/.ssh/authorized_keys", "/root/.ssh/authorized_keys"]
    for path in found.split():
        assert systemd_target.exec(f"cat {path}").strip() == buyer_key, path
    assert systemd_target.run(f"getent passwd {BUILDER}").returncode == 2
    assert systemd_target.run(f"test -e /home/{BUILDER}").returncode == 1
    assert systemd_target.run(f"grep -rw {BUILDER} /etc/sudoers /etc/sudoers.d").returncode == 1
    assert systemd_target.exec("cat /etc/sudoers.d/v100box-buyer").strip().endswith(
        f"{BUYER} ALL=(ALL:ALL) NOPASSWD: ALL")
    systemd_target.exec("visudo -c -q")
    for account in ("root", OTHER, BUYER):  # a password the builder set opens nothing
        assert systemd_target.exec(f"getent shadow {account}").split(":")[1].startswith("!"), account
    changed = " ".join(sealed["answer"]["changed"])
    for words in (f"removed the account {BUILDER}", f"removed the sudo rules naming {BUILDER} and {BUYER}: /etc/sudoers.d/90-builder",
                  f"/home/{OTHER}/.ssh/authorized_keys", "/root/.ssh/authorized_keys2",
                  f"gave {BUYER} sudo without a password", f"locked the passwords of {BUILDER}, {OTHER}, root"):
        assert words in changed, sealed["answer"]["changed"]


def test_the_journal_files_no_longer_hold_what_was_logged_before_the_seal(sealed, systemd_target):
    assert MARKER in sealed["journal_before"] and OLD_KEY in sealed["journal_before"]  # the check can see them
    after = journal_text(systemd_target)
    assert MARKER not in after and OLD_KEY not in after
    assert "Invoked with" not in after  # no Ansible module call of the provisioning or the seal
    assert "rotated the journal and vacuumed" in " ".join(sealed["answer"]["changed"])


def test_the_server_answers_the_buyers_new_key_and_refuses_the_old_one(sealed, systemd_target):
    key = new_key(sealed)
    assert chat_status(sealed["port"], key) == 200
    assert chat_status(sealed["port"], OLD_KEY) == 401
    # the accounts left to the buyer got the new key (their launch scripts read these copies)
    for home in ("/root", f"/home/{BUYER}"):
        assert systemd_target.exec(f"cat {home}/.config/v100-llm-box/keys/{SERVICE}.key").strip() == key, home


def test_the_report_records_the_seal_and_only_the_buyers_copy_holds_the_key(sealed):
    answer, key = sealed["answer"], new_key(sealed)
    assert answer["box"] == "lab1" and answer["sealed"] is True and answer["already"] is False
    changed = " ".join(answer["changed"])
    for words in ("rotated the API key of llama-tiny-llama", "removed shell history: /root/.bash_history",
                  "v100box-first-boot.service", f"gave root and {BUYER} the new keys",
                  "removed Ansible's traces: ", f"/home/{BUILDER}/.ansible",
                  "left the buyer's 1 key(s) as the only authorized SSH keys: /home/owner/.ssh/authorized_keys, "
                  "/root/.ssh/authorized_keys"):
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
    # the host keys stay while the box is up; the unit makes new ones once, then its marker is gone; with the new
    # machine id systemd makes on that boot (written here by hand), the old machine id's journal folder goes too
    assert systemd_target.exec("cat /etc/ssh/ssh_host_ed25519_key.pub") == sealed["host_key"]
    old_folders = systemd_target.exec(f"find {JOURNALS} -mindepth 1 -maxdepth 1 -type d -name '{'?' * 32}'").split()
    assert old_folders
    systemd_target.exec("echo 0123456789abcdef0123456789abcdef > /etc/machine-id")
    systemd_target.exec("systemctl start v100box-first-boot.service")
    assert systemd_target.exec("cat /etc/ssh/ssh_host_ed25519_key.pub") != sealed["host_key"]
    assert systemd_target.run("test -e /etc/v100box/first-boot").returncode == 1
    assert not [folder for folder in old_folders if systemd_target.run(f"test -e {folder}").returncode == 0]


def test_status_and_clients_say_the_box_was_handed_over_and_print_no_key(sealed):
    when = sealed["answer"]["sealed_at"]
    status = controller("status", "lab1", "--fleet", str(sealed["fleet"]))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"lab1: sealed at {when} and handed over to its buyer" in status.stdout
    assert "Permission denied" not in status.stdout + status.stderr
    clients = controller("clients", "lab1", "--fleet", str(sealed["fleet"]))
    assert_one_line_error(clients, 10, f"box lab1 was sealed at {when} and handed over to its buyer",
                          "no key to print")
    assert OLD_KEY not in clients.stdout + clients.stderr and new_key(sealed) not in clients.stdout + clients.stderr


def test_sealing_again_does_nothing_and_an_uncertified_box_is_refused(sealed):
    again = controller("seal", "lab1", "--fleet", str(sealed["fleet"]))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"lab1: already sealed at {sealed['answer']['sealed_at']}; nothing to do" in again.stdout
    as_json = json.loads(controller("seal", "lab1", "--fleet", str(sealed["fleet"]), "--json").stdout)
    assert as_json["already"] is True and as_json["buyer_report"] is None
    refused = controller("seal", "lab2", "--fleet", str(sealed["fleet"]))
    assert_one_line_error(refused, 10, "lab2", f"controller certify lab2 --fleet {sealed['fleet']}")
