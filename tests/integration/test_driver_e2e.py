"""`controller driver` end to end: a box with two V100s and no driver, over real SSH, from a local mirror.

The lab's systemd container stands in for the box. Its PCI bus is a stand-in `lspci` that lists two
V100s (no driver means no nvidia-smi, so the probe reads the bus); the driver comes from the lab's apt
repository of stand-in NVIDIA packages (lab.aptrepo: real names, versions, dependencies, and an
nvidia-smi that reports the same two cards). The container cannot load a kernel module, so the file the
role reads for the loaded module's version is one the test writes, as a reboot would.

Checked: the probe's GPUs reach the role (matched by PCI bus id), the install stops at "reboot needed"
without rebooting, the run after the "reboot" sees both GPUs and changes nothing, the probe then reads
the new driver, and a driver outside the window is refused before anything runs.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import yaml

from lab import aptrepo
from lab.fileserver import FileServer
from lab.target import Target
from tests.cli import run_controller

pytestmark = pytest.mark.podman

PLAN_EXIT = 4
LOADED = "/var/lib/nvidia-standin/version"
# The two cards of the stand-in packages (aptrepo.GPUS), as `lspci -Dnn -d 10de:` prints them.
LSPCI = """\
0000:04:00.0 3D controller [0302]: NVIDIA Corporation GV100GL [Tesla V100 PCIe 32GB] [10de:1db6] (rev a1)
0000:1b:00.0 3D controller [0302]: NVIDIA Corporation GV100GL [Tesla V100 PCIe 32GB] [10de:1db6] (rev a1)
"""
LSPCI_STANDIN = f"""#!/bin/sh
# v100-llm-box test stand-in for lspci: the PCI bus of a box with two V100s.
[ "$*" = "-Dnn -d 10de:" ] || {{ echo "stand-in lspci: unsupported arguments: $*" >&2; exit 2; }}
cat <<'EOF'
{LSPCI}EOF
"""
# The container has no initramfs tools: record each rebuild the role asks for.
INITRAMFS_STANDIN = "#!/bin/sh\necho \"$*\" >> /var/log/update-initramfs.calls\n"
DRIVER_PACKAGES = ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi", "libcuda1", "libnvidia-ml1")


controller = partial(run_controller, timeout=600)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mirror() -> Iterator[str]:
    with FileServer(aptrepo.build()) as server:
        yield server.url


@pytest.fixture(scope="module")
def box(systemd_target: Target) -> Target:
    """The container as a V100 box without a driver that reaches only the lab's mirror."""
    systemd_target.exec("rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*")
    systemd_target.exec("cat > /usr/local/bin/lspci && chmod 755 /usr/local/bin/lspci", input=LSPCI_STANDIN)
    systemd_target.exec("cat > /usr/sbin/update-initramfs && chmod 755 /usr/sbin/update-initramfs",
                        input=INITRAMFS_STANDIN)
    systemd_target.exec(f"mkdir -p {shlex.quote(str(Path(LOADED).parent))}")
    return systemd_target


@pytest.fixture(scope="module")
def fleet(box: Target, mirror: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("driver-e2e") / "fleet.yml"
    path.write_text(yaml.safe_dump({"boxes": {"v100": {
        "address": box.host, "port": box.ssh_port, "user": "root", "key": str(box.key),
        "mirror": {"drivers": mirror, "drivers_trusted": True},
        "vars": {"nvidia_driver_loaded_version_file": LOADED},
    }}}))
    return path


def installed(box: Target) -> dict[str, str]:
    """name -> 'version status' of the NVIDIA packages on the box."""
    out = box.exec("dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' 'nvidia-*' libcuda1 || true")
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines() if line.strip()}


def test_driver_install_stops_for_the_reboot_then_verifies_every_probed_gpu(box: Target, fleet: Path) -> None:
    probed = controller("probe", "v100", "--fleet", str(fleet), "--json")
    assert probed.returncode == 0, probed.stderr
    profile = json.loads(probed.stdout)
    assert [(g["name"], g["pci_bus_id"]) for g in profile["gpus"]] == [
        ("Tesla V100-PCIE-32GB", "00000000:04:00.0"), ("Tesla V100-PCIE-32GB", "00000000:1B:00.0")]
    assert profile["driver"]["version"] is None

    first = controller("driver", "v100", "--fleet", str(fleet), "--json")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    result = last_json(first.stdout)
    assert result["type"] == "driver" and result["status"] == "reboot-needed", result
    assert result["version"] == "580.95.05" and not result["rebooted"]
    assert "reboot needed to load driver 580.95.05 (loaded: none)" in result["message"]
    assert any("a reboot is needed" in note for note in result["notes"])
    host_vars = yaml.safe_load((fleet.parent / "inventory" / "host_vars" / "v100.yml").read_text())
    assert [gpu["pci_bus_id"] for gpu in host_vars["nvidia_driver_gpus"]] == ["00000000:04:00.0", "00000000:1B:00.0"]
    assert not (fleet.parent / "inventory" / "plans" / "v100.json").exists()  # no model named, nothing planned
    packages = installed(box)
    assert packages["nvidia-kernel-dkms"] == "580.95.05-1 hi"  # installed and held
    assert "nvidia-kernel-open-dkms" not in packages or not packages["nvidia-kernel-open-dkms"].endswith(("ii", "hi"))
    assert "nvidia-open" not in packages or not packages["nvidia-open"].endswith(("ii", "hi"))
    assert box.exec("systemctl is-active nvidia-persistenced").strip() == "active"

    # What /proc/driver/nvidia/version says after the reboot that loads the new module.
    box.exec(f"cat > {LOADED}", input="NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  "
                                      "Tue Sep 23 09:32:57 UTC 2025\n")
    second = controller("driver", "v100", "--fleet", str(fleet), "--json")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    result = last_json(second.stdout)
    assert result["status"] == "unchanged" and not result["reboot_required"], result
    assert [(gpu["pci_bus_id"], gpu["driver_version"]) for gpu in result["gpus_seen"]] == [
        ("00000000:04:00.0", "580.95.05"), ("00000000:1B:00.0", "580.95.05")]
    summary = next(json.loads(line) for line in second.stdout.splitlines() if '"type": "summary"' in line)
    assert summary["hosts"]["v100"]["changed"] == 0, summary

    probed = json.loads(controller("probe", "v100", "--fleet", str(fleet), "--json").stdout)
    assert probed["driver"]["version"] == "580.95.05" and len(probed["gpus"]) == 2
    assert probed["gpus"][0]["compute_capability"] == "7.0"


def test_a_driver_outside_the_window_is_refused_before_anything_runs(box: Target, fleet: Path,
                                                                       tmp_path: Path) -> None:
    packages = " ".join(f"{name}=535.247.01-1" for name in DRIVER_PACKAGES)
    box.exec(f"apt-get install -y -q --allow-downgrades --allow-change-held-packages {packages}", timeout=300)
    inventory = tmp_path / "inventory"
    done = controller("driver", "v100", "--fleet", str(fleet), "--inventory", str(inventory))
    assert done.returncode == PLAN_EXIT, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "driver 535.247.01 (R535) is older than R570" in done.stderr
    assert "install an R580 driver with the proprietary kernel modules" in done.stderr
    # Only the host key recorded on first contact (and the inventory's locks) may be there: nothing rendered.
    assert {path.name for path in inventory.iterdir()} <= {"known_hosts", ".lock", ".run.lock"}
    assert installed(box)["nvidia-kernel-dkms"].startswith("535.247.01-1")  # left for the owner to remove
