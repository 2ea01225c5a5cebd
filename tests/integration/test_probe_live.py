"""`controller probe` against a real Linux box: the lab's systemd container over real SSH.

The container has no GPU, so a stand-in nvidia-smi (lab.standin_smi, test harness only)
prints a fixture machine's captured outputs; everything else (SSH, the probe script, /proc, df,
os-release, the parsers, the CLI) is the real thing. Also: the provisioning refusal for a driver
outside R570-R580, the probe's speed (under 3 s), and SSH host keys: recorded on first contact (or
taken from the fleet file), then a changed key refused by the probe and by Ansible.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import partial
from pathlib import Path

import pytest
import yaml

from controller.errors import TransportError
from controller.model.fleet import load_fleet
from controller.stages.probe import parse_outputs
from controller.stages.probe.collect import probe_box
from controller.stages.runner import run_playbook
from controller.stages.strategy import MITOGEN
from controller.stages.transports.known_hosts import parse_public_key
from lab import standin_smi
from lab.target import Target
from tests.cli import run_controller

pytestmark = pytest.mark.podman

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "probe"
PROBE_BUDGET_S = 3.0
PLAN_EXIT = 4


controller = partial(run_controller, timeout=300)


@pytest.fixture(scope="module")
def fleet(systemd_target: Target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("probe-live")
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump({"boxes": {"lab1": {
        "address": systemd_target.host, "port": systemd_target.ssh_port, "user": "root",
        "key": str(systemd_target.key), "model_dir": "/var/lib/llama/models",
    }}}))
    return path


def gpu_facts(profile: dict) -> dict:
    """The part of a profile that comes from nvidia-smi (the rest is the container's own)."""
    return {key: profile[key] for key in ("gpus", "driver", "nvlink", "boards")}


def with_driver(machine: str, old: str, new: str, cuda: tuple[str, str]) -> dict[str, str]:
    """A fixture machine's captures as the same box would print them with another driver installed."""
    captures = standin_smi.captures_from_dir(FIXTURES / machine)
    return {name: text.replace(old, new).replace(f"CUDA Version: {cuda[0]}", f"CUDA Version: {cuda[1]}")
            for name, text in captures.items()}


def test_probe_json_over_ssh_reports_the_fixture_machine(systemd_target: Target, fleet: Path) -> None:
    captures = standin_smi.captures_from_dir(FIXTURES / "twelve-v100-threadripper")
    standin_smi.install(systemd_target, captures)
    done = controller("probe", "lab1", "--fleet", str(fleet), "--json")
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)

    expected = parse_outputs(captures).model_dump(mode="json")
    assert gpu_facts(profile) == gpu_facts(expected)
    assert len(profile["gpus"]) == 12 and profile["gpus"][0]["compute_capability"] == "7.0"
    assert profile["boards"] == [[0, 1], [2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert profile["driver"] == {"version": "580.95.05", "cuda_version": "13.0", "model": None}
    # The rest is the container itself, read over SSH.
    assert profile["os"] == {"family": "linux", "name": "Debian GNU/Linux", "version": "12", "wsl": False}
    assert profile["cpu"]["threads"] == os.cpu_count()
    assert profile["memory_mib"] > 0
    assert profile["disks"][0]["path"] == "/var/lib/llama/models" and profile["disks"][0]["free_mib"] > 0
    assert profile["warnings"] == []
    # One round trip asked for each output once (the query first, with compute_cap).
    asked = standin_smi.calls(systemd_target)
    assert len(asked) == 5 and asked[0].startswith("--query-gpu=index,uuid,") and "compute_cap" in asked[0]
    assert asked[1:] == ["", "-q", "topo -m", "nvlink -s"]
    # nvidia-smi -q gave each card its device node's minor number, which on this box is not its index.
    assert [gpu["minor_number"] for gpu in profile["gpus"]] == [2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9]


def test_a_box_captured_with_the_table_only_takes_gpus_from_the_table(systemd_target: Target, fleet: Path) -> None:
    standin_smi.install(systemd_target, standin_smi.captures_from_dir(FIXTURES / "single-v100-32g-table-only"))
    profile, outputs, _seconds = probe_box(load_fleet(fleet).box("lab1"))
    assert outputs["nvidia-smi-query.csv"] == "" and outputs["nvidia-smi-topo.txt"] == ""
    assert [(gpu.name, gpu.memory_mib) for gpu in profile.gpus] == [("Tesla V100-PCIE-32GB", 32764)]
    assert profile.boards == [[0]]


def test_probe_over_ssh_takes_under_3_s(systemd_target: Target, fleet: Path) -> None:
    standin_smi.install(systemd_target, standin_smi.captures_from_dir(FIXTURES / "twelve-v100-threadripper"))
    box = load_fleet(fleet).box("lab1")
    timings = [probe_box(box)[2] for _ in range(3)]
    assert max(timings) < PROBE_BUDGET_S, timings


@pytest.mark.parametrize(("machine", "old", "new", "cuda", "why"), [
    ("single-v100-16g-linux", "570.172.08", "535.247.01", ("12.8", "12.2"),
     "(R535) is older than R570, which the CUDA 12.8 sm_70 builds need"),
    ("single-v100-16g-linux", "570.172.08", "590.44.01", ("12.8", "13.1"),
     "(R590) is newer than the R580 branch, the last to support Volta"),
])
def test_render_and_provision_refuse_a_driver_outside_the_window(
        systemd_target: Target, fleet: Path, machine: str, old: str, new: str, cuda: tuple[str, str],
        why: str) -> None:
    standin_smi.install(systemd_target, with_driver(machine, old, new, cuda))
    probed = controller("probe", "lab1", "--fleet", str(fleet), "--json")
    assert probed.returncode == 0, probed.stderr
    profile = json.loads(probed.stdout)
    assert profile["driver"]["version"] == new
    assert any(new in warning for warning in profile["warnings"]), profile["warnings"]

    inventory = fleet.parent / f"inventory-{new}"
    for action in ("render", "provision"):
        done = controller(action, "lab1", "--fleet", str(fleet), "--inventory", str(inventory))
        assert done.returncode == PLAN_EXIT, (action, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
        assert f"box lab1: driver {new} {why}" in done.stderr
        assert "install an R580 driver with the proprietary kernel modules" in done.stderr
    assert not (inventory / "hosts.yml").exists()  # refused before anything was rendered or run


def test_a_real_r535_capture_is_refused_naming_the_driver(systemd_target: Target, fleet: Path,
                                                          real_fixtures: Path) -> None:
    table = (real_fixtures / "smi-2xv100-pcie-32gb-linux-535-no-processes.txt").read_text()
    standin_smi.install(systemd_target, {"nvidia-smi.txt": table})
    done = controller("render", "lab1", "--fleet", str(fleet), "--inventory", str(fleet.parent / "inv-535"))
    assert done.returncode == PLAN_EXIT, done.stderr
    assert "driver 535.104.05 (R535) is older than R570" in done.stderr
    assert "install an R580 driver with the proprietary kernel modules" in done.stderr


HOST_KEY_PLAY = """\
- name: Reach the box over SSH
  hosts: all
  gather_facts: false
  tasks:
    - name: Run a command on the box
      ansible.builtin.command: "true"
      changed_when: false
"""


def ansible_inventory(folder: Path, target: Target, name: str) -> Path:
    """What render writes for the box, plus inventory vars that try to switch host-key checking off."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {name: {
        "ansible_host": target.host, "ansible_port": target.ssh_port, "ansible_user": "root",
        "ansible_ssh_private_key_file": str(target.key), "ansible_python_interpreter": "/usr/bin/python3",
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"}}}}))
    (folder / "play.yml").write_text(HOST_KEY_PLAY)
    return folder / "play.yml"


def test_first_contact_records_the_host_key_and_a_changed_key_is_refused(
        target_factory, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    box_target = target_factory()
    port = box_target.ssh_port
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(yaml.safe_dump({"boxes": {"lab2": {
        "address": box_target.host, "port": port, "user": "root", "key": str(box_target.key)}}}))
    inventory = tmp_path / "inventory"
    known = inventory / "known_hosts"
    box = load_fleet(fleet).box("lab2")
    first = parse_public_key(box_target.host_public_key(), "lab2")

    probe_box(box, known_hosts=known)  # trust on first use, said out loud
    assert f"lab2: new host key ssh-ed25519 {first.fingerprint} recorded in {known}" in capfd.readouterr().err
    assert known.read_text() == f"[127.0.0.1]:{port} {box_target.host_public_key()}\n"
    probe_box(box, known_hosts=known)
    assert "new host key" not in capfd.readouterr().err
    play = ansible_inventory(inventory, box_target, "lab2")
    assert run_playbook(str(play), inventory=inventory).status == "successful"  # Ansible reads the same file

    second = parse_public_key(box_target.new_host_key(), "lab2")
    with pytest.raises(TransportError) as probe_refused:
        probe_box(box, known_hosts=known)
    message = str(probe_refused.value)
    assert f"box lab2 (127.0.0.1:{port}): host key refused: the box presents ssh-ed25519 {second.fingerprint}, " \
           f"not the ssh-ed25519 {first.fingerprint} recorded in {known} line 1" in message
    assert message.endswith(f"accept its new key with: ssh-keygen -R '[127.0.0.1]:{port}' -f {known}")
    assert known.read_text() == f"[127.0.0.1]:{port} ssh-ed25519 {first.get_base64()}\n"  # unchanged

    with pytest.raises(TransportError) as ansible_refused:
        run_playbook(str(play), inventory=inventory)
    message = str(ansible_refused.value)
    assert message.startswith(f"box lab2: host key refused by Ansible: the box presents ed25519 {second.fingerprint}")
    assert f"ssh-keygen -R '[127.0.0.1]:{port}' -f {known}" in message and "\n" not in message
    # Under mitogen's strategy (a provision that runs every role) the same recorded key is checked.
    with pytest.raises(TransportError) as mitogen_refused:
        run_playbook(str(play), inventory=inventory, strategy=MITOGEN)
    message = str(mitogen_refused.value)
    assert message.startswith(f"box lab2: host key refused by Ansible: the box does not present the key recorded "
                              f"for it in {known}") and "\n" not in message

    done = controller("driver", "lab2", "--fleet", str(fleet), "--inventory", str(inventory))
    assert done.returncode == 3 and "Traceback" not in done.stderr
    assert f"box lab2 (127.0.0.1:{port}): host key refused" in done.stderr

    # The box was reinstalled, say: the suggested command accepts its new key on the next contact.
    subprocess.run(["ssh-keygen", "-R", f"[127.0.0.1]:{port}", "-f", str(known)], check=True, capture_output=True)
    probe_box(box, known_hosts=known)
    assert f"new host key ssh-ed25519 {second.fingerprint}" in capfd.readouterr().err
    assert run_playbook(str(play), inventory=inventory).status == "successful"


def test_a_host_key_given_in_the_fleet_is_the_only_one_accepted(systemd_target: Target, tmp_path: Path) -> None:
    real = systemd_target.host_public_key()
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    address = {"address": systemd_target.host, "port": systemd_target.ssh_port, "user": "root",
               "key": str(systemd_target.key)}
    # One machine, two fleet files (a fleet refuses two boxes at one address): one pins a wrong key.
    fleets = {}
    for name, key in (("good", real), ("bad", wrong)):
        fleets[name] = tmp_path / f"{name}.yml"
        fleets[name].write_text(yaml.safe_dump({"boxes": {name: {**address, "host_key": key}}}))
    inventory = tmp_path / "inventory"
    known = inventory / "known_hosts"
    with pytest.raises(TransportError, match="host key refused: the box presents .* but host_key in the fleet file"):
        probe_box(load_fleet(fleets["bad"]).box("bad"), known_hosts=known)
    probe_box(load_fleet(fleets["good"]).box("good"), known_hosts=known)
    assert known.read_text() == f"[127.0.0.1]:{systemd_target.ssh_port} {real}\n"  # for Ansible too
    play = ansible_inventory(inventory, systemd_target, "good")
    assert run_playbook(str(play), inventory=inventory).status == "successful"
