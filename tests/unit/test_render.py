"""What render writes into the inventory, and what Ansible makes of it.

Text from a probed box or a catalog reaches Ansible verbatim: a GPU named ``{{ lookup('pipe', ...) }}`` once
ran its command on the controller during a real run. Here a template that creates a marker file is planted
in every string of a hardware profile and in every catalog string that reaches the inventory; the rendered
inventory is read by a real ansible-playbook, which must see the strings as written and never create the
marker. The box's own ``vars:`` from the fleet file are the operator's Ansible variables and still template,
on purpose. One box's damaged probe never stops another box's render.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import Cpu, Disk, Driver, Gpu, HardwareProfile, NvLink, OsInfo
from controller.stages.planner import plan_box, plan_driver
from controller.stages.render import read_rendered, render_box

PROJECT = Path(__file__).resolve().parents[2]
SHA = "ab" * 32


def _plant(model: BaseModel, template: str) -> BaseModel:
    """``model`` with ``template`` appended to every string field that takes free text (a closed choice such
    as the OS family keeps its value), nested models and lists included."""
    data = model.model_dump()
    for name, value in model:
        if isinstance(value, str):
            planted = f"{value} {template}"
        elif isinstance(value, BaseModel):
            planted = _plant(value, template).model_dump()
        elif isinstance(value, list):
            planted = [_plant(item, template).model_dump() if isinstance(item, BaseModel)
                       else f"{item} {template}" if isinstance(item, str) else item for item in value]
        else:
            continue
        try:
            type(model).model_validate({**data, name: planted})
        except ValidationError:
            continue
        data[name] = planted
    return type(model).model_validate(data)


def _profile(template: str, os_family: str) -> HardwareProfile:
    clean = HardwareProfile(
        gpus=[Gpu(index=0, uuid="GPU-1", name="Tesla V100-SXM2-16GB", memory_mib=16384, compute_capability="7.0",
                  pci_bus_id="00000000:04:00.0", serial="1")],
        driver=Driver(version="580.65", cuda_version="13.0", model="TCC" if os_family == "windows" else None),
        nvlink=NvLink(), boards=[[0]], cpu=Cpu(model="Xeon", cores=8, threads=16, flags=["avx2"], avx2=True),
        memory_mib=65536, os=OsInfo(family=os_family, name="Debian", version="12"),
        disks=[Disk(path="/var/lib/llama/models", filesystem="ext4", total_mib=900000, free_mib=800000)],
        warnings=["a warning"])
    planted = _plant(clean, template)
    assert planted.gpus[0].is_v100 and template in planted.cpu.model and template in planted.disks[0].path
    return planted


def _catalog(tmp_path: Path, template: str, url_template: str):
    """Every free-text catalog field that reaches the inventory carries a template (names cannot: see
    test_catalog.py); URLs take the space-free form, since an address may hold no spaces."""
    builtin = load_catalog()
    engine = builtin.engine("upstream-02182fc").model_dump(exclude={"id"})
    engine["load_flags"] = {"mmap": [template], "mlock": [template]}
    data = {
        "hub_url": f"https://hub.example/{url_template}",
        "models": {"tiny": {"name": f"tiny {template}", "repo": "lab/tiny", "file": "tiny.gguf", "size_bytes": 4096,
                            "sha256": SHA, "engine": "upstream"}},
        "engines": {"upstream-02182fc": engine},
        "downloads": {
            "nvidia-windows-573.96": {"url": f"https://driver.example/{url_template}", "sha256": "34" * 32},
            "winsw-2.12.0": {"sha256": "12" * 32},
        },
    }
    path = tmp_path / "catalog.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_catalog([path])


def _hostvars_through_ansible(tmp_path: Path, inventory: Path, hosts: list[str]) -> dict:
    """Each host's variables as a real ansible-playbook run sees them, written to a file by a play on localhost."""
    out = tmp_path / "hostvars.json"
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [{
        "name": "Write the rendered hosts' variables",
        "ansible.builtin.copy": {
            "content": "{{ {" + ", ".join(f"'{host}': hostvars['{host}']" for host in hosts) + "} | to_json }}",
            "dest": str(out), "mode": "0600"}}]}]
    playbook = tmp_path / "dump.yml"
    playbook.write_text(yaml.safe_dump(play, sort_keys=False))
    env = dict(os.environ, ANSIBLE_CONFIG=str(PROJECT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(inventory / "hosts.yml"),
                           str(playbook)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_probed_and_catalog_text_reaches_ansible_verbatim(tmp_path):
    marker = tmp_path / f"PWNED-{uuid.uuid4().hex}"
    template = f"{{{{ lookup('pipe', 'touch {marker}') }}}}"
    url_template = f"{{{{lookup('pipe','touch${{IFS}}{marker}')}}}}"
    catalog = _catalog(tmp_path, template, url_template)
    mirror = {"engines": "https://mirror.example/engines"}
    fleet = parse_fleet({"boxes": {
        "lin1": {"address": "192.0.2.5", "user": f"ops{url_template}", "models": [{"id": "tiny", "ctx": 2048}],
                 "mirror": mirror, "vars": {"operator_answer": "{{ 40 + 2 }}"}},
        "win1": {"address": "192.0.2.7", "os": "windows", "transport": "winrm", "models": [{"id": "tiny", "ctx": 2048}],
                 "mirror": mirror},
    }}, tmp_path / "fleet.yml")
    inventory = tmp_path / "inventory"
    rendered = {}
    for name, os_family in (("lin1", "linux"), ("win1", "windows")):
        box, profile = fleet.box(name), _profile(template, os_family)
        plan = plan_box(box, profile, catalog)
        assert plan.fits, plan.unplaced
        render_box(inventory, fleet, box, profile, plan)
        rendered[name] = read_rendered((inventory / "host_vars" / f"{name}.yml").read_text())
    assert "!unsafe" in (inventory / "host_vars" / "lin1.yml").read_text()
    assert "Tesla V100-SXM2-16GB" in (inventory / "host_vars" / "lin1.yml").read_text()  # plain text stays plain

    seen = _hostvars_through_ansible(tmp_path, inventory, ["lin1", "win1"])

    assert not marker.exists(), "a template from a probe or a catalog was evaluated on the controller"
    lin, win = seen["lin1"], seen["win1"]
    assert lin["nvidia_driver_gpus"][0]["name"] == f"Tesla V100-SXM2-16GB {template}"
    assert lin["nvidia_driver_gpus"][0]["pci_bus_id"] == f"00000000:04:00.0 {template}"
    (instance,) = lin["llama_service_instances"]
    assert instance["args"][-1] == template  # the engine's load flags
    assert lin["gguf_model_files"][0]["url"] == f"https://hub.example/{url_template}/lab/tiny/resolve/main/tiny.gguf"
    assert lin["ansible_user"] == f"ops{url_template}"
    assert win["nvidia_driver_gpus"][0]["name"] == f"Tesla V100-SXM2-16GB {template}"
    assert win["nvidia_driver_installer"]["url"] == f"https://driver.example/{url_template}"
    assert win["llama_service_instances"][0]["args"][-1] == template
    # Ansible saw exactly what the controller wrote, for every variable the controller wrote.
    for name, host_vars in rendered.items():
        for key, value in host_vars.items():
            if key != "operator_answer":
                assert seen[name][key] == value, key
    # The operator's own vars: are Ansible variables and may template on purpose.
    assert lin["operator_answer"] == 42


def test_a_damaged_probe_of_another_box_does_not_stop_this_render(tmp_path, capsys):
    fleet = parse_fleet({"boxes": {"a1": {"address": "192.0.2.5"}, "b2": {"address": "192.0.2.6"},
                                   "c3": {"address": "192.0.2.7", "os": "windows", "transport": "winrm"}}},
                        tmp_path / "fleet.yml")
    inventory = tmp_path / "inventory"
    (inventory / "probes").mkdir(parents=True)
    (inventory / "probes" / "b2.json").write_text('{"gpus": [{"index": 0')  # cut short by a full disk
    (inventory / "probes" / "c3.json").write_bytes(b"\xff\xfe{\x00}")  # not UTF-8 at all
    profile = HardwareProfile(gpus=[Gpu(index=0, name="Tesla V100-PCIE-16GB", memory_mib=16384)],
                              os=OsInfo(family="linux"))

    render_box(inventory, fleet, fleet.box("a1"), profile, None, plan_driver(fleet.box("a1"), profile, load_catalog()))

    groups = read_rendered((inventory / "hosts.yml").read_text())["all"]["children"]
    assert set(groups["single_v100_16g"]["hosts"]) == {"a1"}
    assert set(groups["linux"]["hosts"]) == {"a1", "b2"} and set(groups["windows"]["hosts"]) == {"c3"}
    assert groups["linux"]["hosts"]["b2"]["ansible_host"] == "192.0.2.6"  # still reachable by Ansible
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(line.startswith("warning: ") for line in warnings)
    assert "b2.json" in warnings[0] and "controller render b2" in warnings[0] and "c3.json" in warnings[1]


def test_plain_ansible_checks_the_host_keys_the_controller_recorded(tmp_path):
    fleet = parse_fleet({"boxes": {"a1": {"address": "192.0.2.5", "port": 2222},
                                   "c3": {"address": "192.0.2.7", "os": "windows", "transport": "winrm"}}},
                        tmp_path / "fleet.yml")
    inventory = tmp_path / "my inventory"
    box = fleet.box("a1")
    render_box(inventory, fleet, box, HardwareProfile(), None, plan_driver(box, HardwareProfile(), load_catalog()))

    hosts = read_rendered((inventory / "hosts.yml").read_text())["all"]["children"]
    ssh_args = hosts["linux"]["hosts"]["a1"]["ansible_ssh_common_args"]
    assert ssh_args == f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile='{inventory.resolve()}/known_hosts'"
    assert "ansible_ssh_common_args" not in hosts["windows"]["hosts"]["c3"]


def test_a_box_reached_as_a_sudo_account_becomes_root_as_a_workstation_does(tmp_path):
    """`user: builder` with the fleet's default `become: true` gets sudo for its root tasks (and sudo the login
    password when there is one); root, `become: false` and WinRM get none. Workstations take the same connection_vars."""
    from controller.stages.render import connection_vars, secrets_for

    (tmp_path / "pw").write_text("builder-password")
    fleet = parse_fleet({"boxes": {"b1": {"address": "192.0.2.5", "user": "builder", "password": {"file": str(tmp_path / "pw")}},
                                   "b2": {"address": "192.0.2.6"},
                                   "b3": {"address": "192.0.2.7", "user": "builder", "become": False},
                                   "c3": {"address": "192.0.2.8", "os": "windows", "transport": "winrm", "user": "admin"}}},
                        tmp_path / "fleet.yml")
    assert connection_vars(fleet.box("b1"))["ansible_become"] is True
    assert secrets_for(fleet.box("b1"))["ansible_become_password"] == "builder-password"
    assert [("ansible_become" in connection_vars(fleet.box(name))) for name in ("b2", "b3", "c3")] == [False] * 3
