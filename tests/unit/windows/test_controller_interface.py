"""What the controller renders for a Windows box is accepted by the merged roles' argument specs (CONTRACT: the
roles' own names, no win_ prefix) and renders a valid service."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import yaml

from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.stages.planner import plan_box
from controller.stages.render import render_box
from tests.unit.planner.helpers import DUAL, profile
from tests.unit.windows.ansible_local import MERGED_ROLES, PROJECT, run_playbook
from tests.unit.windows.cmdline import split
from tests.unit.windows.test_service_render import render

# Each module runs ansible-playbook on localhost: seconds per run.
pytestmark = pytest.mark.slow


def _render(tmp, os_name: str) -> dict:
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
        "os": os_name,
        "transport": "winrm" if os_name == "windows" else "ssh",
        "mirror": {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1"},
        "models": [{"id": "qwen3.6-27b-q4_k_m", "agents": 4}],
    }
    fleet = parse_fleet({"boxes": {"win1": box_body}}, tmp / "fleet.yml")
    box = fleet.box("win1")
    hardware = profile(DUAL)
    plan = plan_box(box, hardware, catalog)
    paths = render_box(tmp / "inv", fleet, box, hardware, plan)
    return yaml.safe_load(next(p for p in paths if p.name == "win1.yml").read_text())


@pytest.fixture(scope="module")
def host_vars(tmp_path_factory) -> dict:
    return _render(tmp_path_factory.mktemp("controller"), "windows")


@pytest.fixture(scope="module", params=["windows", "linux", "example"])
def any_host_vars(request, tmp_path_factory) -> dict:
    if request.param == "example":  # the README's hand-written inventory keeps the same contract
        return yaml.safe_load((PROJECT / "inventory" / "example" / "host_vars" / "box3.yml").read_text())
    return _render(tmp_path_factory.mktemp("controller"), request.param)


def _without_defaults(spec: dict) -> dict:
    """The spec less its defaults: some are templates over role vars, and only the provided values are checked."""
    out = {}
    for name, option in spec.items():
        option = {key: value for key, value in option.items() if key != "default"}
        if "options" in option:
            option["options"] = _without_defaults(option["options"])
        out[name] = option
    return out


def test_every_rendered_input_fits_a_role_argument_spec(tmp_path, any_host_vars):
    host_vars = any_host_vars
    assert not [key for key in host_vars if key.startswith("win_")], "the contract has no win_ names"
    tasks = []
    for role in MERGED_ROLES:
        spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
        provided = {key: value for key, value in host_vars.items() if key.startswith(role.name + "_")}
        assert set(provided) <= set(spec), f"{role.name} has no option for {set(provided) - set(spec)}"
        required = {name for name, option in spec.items() if option.get("required")}
        assert required <= set(provided), f"render leaves out {role.name}'s required {required - set(provided)}"
        tasks.append(
            {
                "name": f"Validate the inputs of {role.name}",
                "ansible.builtin.validate_argument_spec": {
                    "argument_spec": _without_defaults(spec),
                    "provided_arguments": provided,
                },
            }
        )
    # The facts the controller owns reach the roles through the inventory.
    assert host_vars["nvidia_driver_window"]["label"] and host_vars["gguf_model_dir"]
    assert host_vars["llama_service_template_dir"]
    assert "llama_service_winsw" not in host_vars or host_vars["llama_service_winsw"]["sha256"]
    result = run_playbook(tmp_path, [{"name": "Specs", "hosts": "localhost", "gather_facts": False, "tasks": tasks}])
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendered_instance_becomes_a_service_running_the_installed_pack(tmp_path, host_vars):
    keys = ("llama_engine_root", "gguf_model_dir", "llama_service_template_dir")
    out = render(tmp_path, host_vars["llama_service_bind"], "", host_vars["llama_service_instances"],
                 more_vars={k: v for k, v in host_vars.items() if k in keys})
    packs = {(pack["name"], str(pack["version"])): pack for pack in host_vars["llama_engine_packs"]}
    for instance in host_vars["llama_service_instances"]:
        root = ET.parse(out / f"{instance['name']}.xml").getroot()
        assert (instance["engine"], str(instance["version"])) in packs, "the service runs a pack nobody installs"
        assert root.findtext("executable").endswith(
            rf"\{instance['engine']}\{instance['version']}\bin\llama-server.exe"
        )
        assert split(root.findtext("arguments")) == [str(arg) for arg in instance["args"]]
        env = {e.get("name"): e.get("value") for e in root.findall("env")}
        assert env == {k: str(v) for k, v in (instance.get("env") or {}).items()}
