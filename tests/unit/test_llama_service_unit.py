"""The llama_service unit, rendered by Ansible's own template engine, scores under 2.0 in
`systemd-analyze security --offline=yes` (it scored 5.2 before the hardening of issue 9) and opens
only what its instance needs: its own GPUs, netlink only for NCCL, the allowed networks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller import facts

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "llama_service"
THRESHOLD = 2.0
PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Render each instance's unit
      ansible.builtin.template:
        src: {role}/templates/llama.service.j2
        dest: "{out}/{{{{ item.name }}}}.service"
        mode: "0644"
      loop: "{{{{ llama_service_instances }}}}"
"""
INSTANCES = [
    # Gemma on the second card of two, loopback only.
    {"name": "llama-gemma", "model": "gemma", "engine": "upstream", "port": 8011,
     "args": ["--model", "/var/lib/llama/models/gemma.gguf", "--port", "8011"], "env": {"CUDA_VISIBLE_DEVICES": "1"}},
    # Qwen with NCCL over both cards, --mlock, exposed to the LAN.
    {"name": "llama-qwen", "model": "qwen", "engine": "nccl", "port": 8001, "mlock": True,
     "args": ["--model", "/var/lib/llama/models/qwen.gguf", "--host", "0.0.0.0", "--port", "8001"],
     "env": {"CUDA_VISIBLE_DEVICES": "0,1", "GGML_CUDA_ALLREDUCE": "nccl"}},
    # A CPU engine and no CUDA_VISIBLE_DEVICES: every probed card.
    {"name": "llama-cpu", "model": "tiny", "engine": "cpu", "port": 8021,
     "args": ["--model", "/var/lib/llama/models/tiny.gguf", "--port", "8021"]},
]


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing (Debian 12's systemd package has it)")
        pytest.skip("systemd-analyze is not installed here")
    return found


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("units")
    playbook = out / "render.yml"
    playbook.write_text(PLAYBOOK.format(role=ROLE, out=out))
    extra = out / "vars.yml"
    extra.write_text(yaml.safe_dump({
        **yaml.safe_load((ROLE / "defaults/main.yml").read_text()),
        **yaml.safe_load((ROLE / "vars/main.yml").read_text()),
        "llama_service_instances": INSTANCES,
        # The --host in the arguments decides what is exposed, whatever llama_service_bind says.
        "llama_service_bind": "127.0.0.1",
        "llama_service_api_key": "0123456789abcdef0123",
        "llama_service_allow_from": ["192.168.1.0/24", "2001:db8::/32"],
        "nvidia_driver_gpus": [{"index": 0}, {"index": 1}],
        "gguf_model_dir": facts.DEFAULT_MODEL_DIR["linux"],  # render passes it; the role has no default
        "llama_service_template_dir": facts.TEMPLATE_DIR["linux"],
        "ansible_python_interpreter": sys.executable,
    }))
    env = {**os.environ, "ANSIBLE_FILTER_PLUGINS": str(ROOT / "plugins/filter"), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), str(playbook), "-e", f"@{extra}"],
                          env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return {instance["name"]: out / f"{instance['name']}.service" for instance in INSTANCES}


def _lines(unit: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith(key + "=")]


@pytest.mark.parametrize("name", [instance["name"] for instance in INSTANCES])
def test_unit_exposure_is_under_two(units, name):
    done = subprocess.run([_systemd_analyze(), "security", "--offline=yes", "--no-pager", str(units[name])],
                          capture_output=True, text=True, check=False)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout + done.stderr)
    assert found, done.stdout[-2000:] + done.stderr
    assert float(found.group(1)) < THRESHOLD, done.stdout


def test_unit_opens_only_its_own_gpus(units):
    gemma, qwen, cpu = units["llama-gemma"], units["llama-qwen"], units["llama-cpu"]
    assert _lines(gemma, "DevicePolicy") == ["closed"]
    assert "/dev/nvidia1 rw" in _lines(gemma, "DeviceAllow")
    assert "/dev/nvidia0 rw" not in _lines(gemma, "DeviceAllow")
    assert {"/dev/nvidia0 rw", "/dev/nvidia1 rw", "/dev/nvidiactl rw", "/dev/nvidia-uvm rw"} <= set(_lines(qwen, "DeviceAllow"))
    assert {"/dev/nvidia0 rw", "/dev/nvidia1 rw"} <= set(_lines(cpu, "DeviceAllow"))


def test_netlink_only_for_nccl_and_ip_allow_list(units):
    assert "AF_NETLINK" not in _lines(units["llama-gemma"], "RestrictAddressFamilies")[0]
    assert "AF_NETLINK" in _lines(units["llama-qwen"], "RestrictAddressFamilies")[0]
    assert _lines(units["llama-qwen"], "IPAddressDeny") == ["any"]
    assert set(" ".join(_lines(units["llama-qwen"], "IPAddressAllow")).split()) == {
        "localhost", "192.168.1.0/24", "2001:db8::/32"}
    # Only the exposed instance waits for the firewall table and refuses to run without it.
    assert _lines(units["llama-qwen"], "Requires") == ["llama-service-firewall.service"]
    assert _lines(units["llama-gemma"], "Requires") == []


def test_models_and_engines_are_read_only(units):
    unit = units["llama-gemma"]
    read_only = " ".join(_lines(unit, "ReadOnlyPaths")).split()
    assert {"-/var/lib/llama/models", "-/opt/llama", "-/var/lib/llama"} <= set(read_only)
    assert _lines(unit, "ReadWritePaths") == []
    assert _lines(unit, "ProtectSystem") == ["strict"]
    assert _lines(unit, "StateDirectory") == ["llama-service/llama-gemma"]
    assert _lines(unit, "UMask") == ["0077"]
