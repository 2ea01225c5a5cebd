"""The llama_service unit, rendered by Ansible's own template engine, scores under 2.0 in
`systemd-analyze security --offline=yes` (it scored 5.2 before the hardening of issue 9) and opens
only what its instance needs: its own GPUs' device nodes by minor number, netlink only for NCCL, the
allowed networks; it starts after the boot unit that makes those nodes, and refuses writable and
executable memory when its build compiles nothing at run time (issue 20)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.model import rules

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "ansible_collections/v100box/llm/roles" / "llama_service"
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

    - name: Render the boot unit that makes the device nodes
      ansible.builtin.template:
        src: {role}/templates/nvidia-nodes.service.j2
        dest: "{out}/nodes.service"
        mode: "0644"
"""
UUID0, UUID1 = "GPU-0fa0c0de-1111-2222-3333-444455556666", "GPU-0fa0c0de-7777-8888-9999-aaaabbbbcccc"
# The driver made the second card's node first: the card nvidia-smi calls 1 is /dev/nvidia0.
GPUS = [{"index": 0, "name": "Tesla V100-SXM2-32GB", "uuid": UUID0, "minor_number": 1},
        {"index": 1, "name": "Tesla V100-SXM2-32GB", "uuid": UUID1, "minor_number": 0}]
INSTANCES = [
    # Hand-written: Gemma on the second card of two by index, loopback only.
    {"name": "llama-gemma", "model": "gemma", "engine": "upstream", "port": 8011,
     "args": ["--model", "/var/lib/llama/models/gemma.gguf", "--port", "8011"], "env": {"CUDA_VISIBLE_DEVICES": "1"}},
    # Hand-written: Qwen with NCCL over both cards named by UUID, --mlock, exposed to the LAN.
    {"name": "llama-qwen", "model": "qwen", "engine": "nccl", "port": 8001, "mlock": True,
     "args": ["--model", "/var/lib/llama/models/qwen.gguf", "--host", "0.0.0.0", "--port", "8001"],
     "env": {"CUDA_VISIBLE_DEVICES": f"{UUID0},{UUID1}", "GGML_CUDA_ALLREDUCE": "nccl"}},
    # Hand-written: a CPU engine and no CUDA_VISIBLE_DEVICES: every probed card.
    {"name": "llama-cpu", "model": "tiny", "engine": "cpu", "port": 8021,
     "args": ["--model", "/var/lib/llama/models/tiny.gguf", "--port", "8021"]},
    # As the controller renders a GPU service: its card's node by minor number, and a build with code for the card.
    {"name": "llama-planned", "model": "gemma", "engine": "upstream", "port": 8031,
     "args": ["--model", "/var/lib/llama/models/gemma.gguf", "--port", "8031"],
     "env": {"CUDA_VISIBLE_DEVICES": UUID0}, "gpu_minors": [7], "memory_deny_write_execute": True},
    # As the controller renders a CPU service: no GPU node at all.
    {"name": "llama-planned-cpu", "model": "tiny", "engine": "cpu", "port": 8041,
     "args": ["--model", "/var/lib/llama/models/tiny.gguf", "--port", "8041"],
     "gpu_minors": [], "memory_deny_write_execute": True},
    # As the controller renders an on-demand group: a router, its models in the preset file.
    {"name": "llama-on-demand", "model": "tiny", "models": ["tiny", "tools"], "engine": "cpu", "port": 8051,
     "args": ["--models-preset", "/etc/llama/presets/llama-on-demand.ini", "--models-max", "1", "--host", "127.0.0.1",
              "--port", "8051"],
     "gpu_minors": [], "memory_deny_write_execute": True,
     "on_demand": {"preset_file": "/etc/llama/presets/llama-on-demand.ini", "key_file_env": "LLAMA_ARG_API_KEY_FILE",
                   "max_loaded": 1, "models": [{"id": "tiny", "preset": {"model": "/m/tiny.gguf"}},
                                               {"id": "tools", "preset": {"model": "/m/tools.gguf"}}]}},
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
        "nvidia_driver_gpus": GPUS,
        "gguf_model_dir": rules.DEFAULT_MODEL_DIR["linux"],  # render passes it; the role has no default
        "llama_service_template_dir": rules.TEMPLATE_DIR["linux"],
        "ansible_python_interpreter": sys.executable,
    }))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), str(playbook), "-e", f"@{extra}"],
                          env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return {instance["name"]: out / f"{instance['name']}.service" for instance in INSTANCES} | {
        "nodes": out / "nodes.service"}


def _lines(unit: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith(key + "=")]


@pytest.mark.parametrize("name", [instance["name"] for instance in INSTANCES])
def test_unit_exposure_is_under_two(units, name):
    done = subprocess.run([_systemd_analyze(), "security", "--offline=yes", "--no-pager", str(units[name])],
                          capture_output=True, text=True, check=False)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout + done.stderr)
    assert found, done.stdout[-2000:] + done.stderr
    assert float(found.group(1)) < THRESHOLD, done.stdout


def test_unit_opens_only_its_own_gpus_by_minor_number(units):
    gemma, qwen, cpu = units["llama-gemma"], units["llama-qwen"], units["llama-cpu"]
    assert _lines(gemma, "DevicePolicy") == ["closed"]
    # nvidia-smi's GPU 1 is the node with minor number 0, not /dev/nvidia1.
    assert _lines(gemma, "DeviceAllow") == ["/dev/nvidia0 rw", "/dev/nvidiactl rw", "/dev/nvidia-uvm rw"]
    assert _lines(qwen, "DeviceAllow") == ["/dev/nvidia1 rw", "/dev/nvidia0 rw", "/dev/nvidiactl rw",
                                           "/dev/nvidia-uvm rw"]
    assert {"/dev/nvidia0 rw", "/dev/nvidia1 rw"} <= set(_lines(cpu, "DeviceAllow"))
    assert _lines(units["llama-planned"], "DeviceAllow") == ["/dev/nvidia7 rw", "/dev/nvidiactl rw",
                                                             "/dev/nvidia-uvm rw"]
    assert _lines(units["llama-planned-cpu"], "DeviceAllow") == []


def test_nodes_cuda_never_opened_stay_closed(units):
    """Recorded on driver 580: CUDA opened nvidiactl, nvidia<minor> and nvidia-uvm, never the rest."""
    for name in ("llama-gemma", "llama-qwen", "llama-cpu", "llama-planned"):
        allowed = " ".join(_lines(units[name], "DeviceAllow"))
        assert "nvidia-uvm-tools" not in allowed and "nvidia-modeset" not in allowed and "nvidia-caps" not in allowed


def test_a_server_on_gpus_starts_only_after_the_boot_unit_made_its_nodes(units):
    for name in ("llama-gemma", "llama-qwen", "llama-cpu", "llama-planned"):
        assert "v100box-nvidia-nodes.service" in _lines(units[name], "Requires"), name
        assert "v100box-nvidia-nodes.service" in _lines(units[name], "After"), name
    assert "v100box-nvidia-nodes.service" not in " ".join(_lines(units["llama-planned-cpu"], "After"))
    assert _lines(units["llama-planned-cpu"], "Requires") == []
    nodes = units["nodes"]
    # The control node (minor 255) and every card some server opens, then nvidia_uvm and its node.
    assert _lines(nodes, "ExecStart") == ["/usr/bin/nvidia-modprobe -c=255 -c=0 -c=1 -c=7",
                                          "/usr/bin/nvidia-modprobe -u -c=0"]
    assert _lines(nodes, "Type") == ["oneshot"] and _lines(nodes, "RemainAfterExit") == ["yes"]
    assert _lines(nodes, "WantedBy") == ["multi-user.target"]
    assert "X-V100Box-Managed=yes" not in nodes.read_text()  # never taken for a llama unit and removed


def test_write_execute_memory_is_refused_only_where_nothing_compiles_at_run_time(units):
    assert _lines(units["llama-planned"], "MemoryDenyWriteExecute") == ["yes"]
    assert _lines(units["llama-planned-cpu"], "MemoryDenyWriteExecute") == ["yes"]
    for name in ("llama-gemma", "llama-qwen", "llama-cpu"):  # nothing says what their builds carry
        assert _lines(units[name], "MemoryDenyWriteExecute") == []
        assert "MemoryDenyWriteExecute= stays off" in units[name].read_text()
    for unit in units.values():  # CUDA reads /proc/driver/nvidia/params and /proc/devices
        assert _lines(unit, "ProcSubset") == []
    assert "ProcSubset=pid stays off: CUDA reads /proc/driver/nvidia/params and /proc/devices" in \
        units["llama-planned"].read_text()


def test_netlink_only_for_nccl_and_ip_allow_list(units):
    assert "AF_NETLINK" not in _lines(units["llama-gemma"], "RestrictAddressFamilies")[0]
    assert "AF_NETLINK" in _lines(units["llama-qwen"], "RestrictAddressFamilies")[0]
    assert _lines(units["llama-qwen"], "IPAddressDeny") == ["any"]
    assert set(" ".join(_lines(units["llama-qwen"], "IPAddressAllow")).split()) == {
        "localhost", "192.168.1.0/24", "2001:db8::/32"}
    # Only the exposed instance waits for the firewall table and refuses to run without it.
    assert "llama-service-firewall.service" in _lines(units["llama-qwen"], "Requires")
    assert "llama-service-firewall.service" not in _lines(units["llama-gemma"], "Requires")


def test_models_and_engines_are_read_only(units):
    unit = units["llama-gemma"]
    read_only = " ".join(_lines(unit, "ReadOnlyPaths")).split()
    assert {"-/var/lib/llama/models", "-/opt/llama", "-/var/lib/llama"} <= set(read_only)
    assert _lines(unit, "ReadWritePaths") == []
    assert _lines(unit, "ProtectSystem") == ["strict"]
    assert _lines(unit, "StateDirectory") == ["llama-service/llama-gemma"]
    assert _lines(unit, "UMask") == ["0077"]


def test_a_router_gets_its_key_file_in_the_environment_its_models_servers_inherit(units):
    # A key flag reaches the router only (it strips it from its models' servers, which would then answer anyone on
    # loopback); the variable reaches them all.
    router = units["llama-on-demand"]
    assert _lines(router, "Environment") == ["LLAMA_CACHE=%C/llama-service/llama-on-demand",
                                             "LLAMA_ARG_API_KEY_FILE=%d/api-key"]
    (start,) = _lines(router, "ExecStart")
    assert "--api-key-file" not in start and '"--models-preset" "/etc/llama/presets/llama-on-demand.ini"' in start
    assert "--api-key-file" in _lines(units["llama-planned-cpu"], "ExecStart")[0]
