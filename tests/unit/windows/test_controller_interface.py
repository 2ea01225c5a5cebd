"""What the controller renders for a Windows box is accepted by the win_* roles' argument specs and renders a valid service."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import yaml

from controller.catalog import load_catalog
from controller.fleet import parse_fleet
from controller.planner import plan_box
from controller.render import render_box
from tests.unit.planner.helpers import DUAL, profile
from tests.unit.windows.ansible_local import ROLES, WIN_ROLES, role_vars, run_playbook
from tests.unit.windows.cmdline import split

# Each module runs ansible-playbook on localhost: seconds per run.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def host_vars(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("controller")
    builtin = load_catalog()
    pins = {
        "models": {"qwen3.6-27b-q4_k_m": builtin.model("qwen3.6-27b-q4_k_m").model_dump(exclude={"id", "hub_url"})},
        "downloads": {"winsw-2.12.0": {"sha256": "12" * 32}, "nvidia-windows-573.96": {"sha256": "34" * 32}},
    }
    pins["models"]["qwen3.6-27b-q4_k_m"]["sha256"] = "ab" * 32
    (tmp / "pins.yml").write_text(yaml.safe_dump(pins))
    catalog = load_catalog([tmp / "pins.yml"])
    box_body = {
        "address": "192.0.2.7",
        "os": "windows",
        "transport": "winrm",
        "mirror": {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1"},
        "models": [{"id": "qwen3.6-27b-q4_k_m", "agents": 4}],
    }
    fleet = parse_fleet({"boxes": {"win1": box_body}}, tmp / "fleet.yml")
    box = fleet.box("win1")
    hardware = profile(DUAL)
    plan = plan_box(box, hardware, catalog)
    paths = render_box(tmp / "inv", fleet, box, hardware, plan, catalog)
    return yaml.safe_load(next(p for p in paths if p.name == "win1.yml").read_text())


def _without_defaults(spec: dict) -> dict:
    """The spec less its defaults: some are templates over role vars, and only the provided values are checked."""
    out = {}
    for name, option in spec.items():
        option = {key: value for key, value in option.items() if key != "default"}
        if "options" in option:
            option["options"] = _without_defaults(option["options"])
        out[name] = option
    return out


def test_every_rendered_input_fits_a_role_argument_spec(tmp_path, host_vars):
    tasks = []
    for role in WIN_ROLES:
        spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
        provided = {key: value for key, value in host_vars.items() if key.startswith(role.name + "_")}
        assert set(provided) <= set(spec), f"{role.name} has no option for {set(provided) - set(spec)}"
        tasks.append(
            {
                "name": f"Validate the inputs of {role.name}",
                "ansible.builtin.validate_argument_spec": {
                    "argument_spec": _without_defaults(spec),
                    "provided_arguments": provided,
                },
            }
        )
    covered = {key for key in host_vars if key.startswith(tuple(role.name + "_" for role in WIN_ROLES))}
    assert covered == {key for key in host_vars if key.startswith("win_")}
    result = run_playbook(tmp_path, [{"name": "Specs", "hosts": "localhost", "gather_facts": False, "tasks": tasks}])
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendered_instance_becomes_a_service_running_the_installed_pack(tmp_path, host_vars):
    out = tmp_path / "out"
    out.mkdir()
    plays = [
        {
            "name": "Render",
            "hosts": "localhost",
            "gather_facts": False,
            "vars_files": role_vars("win_llama_service"),
            "tasks": [
                {
                    "name": "Render the WinSW XML",
                    "ansible.builtin.template": {
                        "src": str(ROLES / "win_llama_service" / "templates" / "winsw.xml.j2"),
                        "dest": f"{out}/{{{{ item.name }}}}.xml",
                        "mode": "0600",
                    },
                    "loop": "{{ win_llama_service_instances }}",
                }
            ],
        }
    ]
    keys = ("win_llama_service_instances", "win_llama_service_bind", "win_llama_engine_root")
    result = run_playbook(tmp_path, plays, {k: v for k, v in host_vars.items() if k in keys})
    assert result.returncode == 0, result.stdout + result.stderr
    packs = {(pack["name"], str(pack["version"])): pack for pack in host_vars["win_llama_engine_packs"]}
    for instance in host_vars["win_llama_service_instances"]:
        root = ET.parse(out / f"{instance['name']}.xml").getroot()
        assert (instance["engine"], str(instance["version"])) in packs, "the service runs a pack nobody installs"
        assert root.findtext("executable").endswith(
            rf"\{instance['engine']}\{instance['version']}\bin\llama-server.exe"
        )
        assert split(root.findtext("arguments")) == [str(arg) for arg in instance["args"]]
        env = {e.get("name"): e.get("value") for e in root.findall("env")}
        assert env == {k: str(v) for k, v in (instance.get("env") or {}).items()}
