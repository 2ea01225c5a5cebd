"""Workstations of the fleet: how they are named and checked, and what is rendered for them (no key in it)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from controller.actions.workstation import render_workstation, workstation_secrets, workstation_vars
from controller.errors import FleetError, NotRendered
from controller.inventory import Inventory
from controller.model.fleet import WantedModel, load_fleet
from controller.stages.planner import plan_models
from controller.stages.render import read_rendered
from tests.cli import run_controller
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.planner.helpers import CPU_ONLY, catalog, profile

GATE = "qwen3-4b-instruct-2507-q8_0"
SMALL = "qwen2.5-coder-0.5b-instruct-q8_0"
KEY = "k3y-for-box1-0123456789"
OTHER_KEY = "k3y-for-box2-9876543210"


def _fleet(tmp_path: Path) -> dict:
    (tmp_path / "box1.key").write_text(KEY + "\n")
    (tmp_path / "box2.key").write_text(OTHER_KEY + "\n")
    return {
        "defaults": {"user": "ops", "key": "id_test", "models": [{"id": GATE}]},
        "boxes": {
            "box1": {"address": "192.0.2.7", "bind": "0.0.0.0", "allow_from": ["192.0.2.0/24"],
                     "api_key": {"file": str(tmp_path / "box1.key")}},
            "box2": {"address": "192.0.2.8", "bind": "0.0.0.0", "allow_from": ["192.0.2.0/24"],
                     "api_key": {"file": str(tmp_path / "box2.key")}},
        },
        "workstations": {
            "desk": {"address": "192.0.2.50", "accounts": ["alice", "bob"], "boxes": ["box1"]},
        },
    }


def _write(tmp_path: Path, fleet: dict) -> Path:
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(fleet))
    return path


def _load(tmp_path: Path, fleet: dict):
    return load_fleet(_write(tmp_path, fleet))


def _plan(tmp_path: Path, box: str, bind: str = "0.0.0.0", model: str = GATE) -> None:
    result = plan_models([WantedModel(id=model)], profile(CPU_ONLY), catalog(), host=bind)
    folder = tmp_path / "inventory" / "plans"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{box}.json").write_text(result.model_dump_json())


def _refused(tmp_path: Path, fleet: dict, *words: str) -> None:
    with pytest.raises(FleetError) as caught:
        _load(tmp_path, fleet)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_a_workstation_is_reached_like_a_box_and_takes_the_connection_defaults(tmp_path):
    fleet = _load(tmp_path, _fleet(tmp_path))
    desk = fleet.workstation("desk")
    assert (desk.user, desk.key, desk.effective_port) == ("ops", tmp_path / "id_test", 22)  # defaults, relative key
    assert desk.wired_accounts == ["alice", "bob"] and desk.openclaw is True
    bare = _fleet(tmp_path)
    bare["workstations"]["desk"].pop("accounts")
    assert _load(tmp_path, bare).workstation("desk").wired_accounts == ["ops"]  # the login account


def test_a_workstation_naming_an_unknown_box_is_refused_with_the_boxes(tmp_path):
    fleet = _fleet(tmp_path)
    fleet["workstations"]["desk"]["boxes"] = ["box9"]
    _refused(tmp_path, fleet, "workstation 'desk'", "'box9'", "box1, box2")


def test_a_box_whose_key_the_controller_lacks_is_refused(tmp_path):
    fleet = _fleet(tmp_path)
    del fleet["boxes"]["box1"]["api_key"]
    fleet["boxes"]["box1"]["bind"] = "127.0.0.1"
    fleet["boxes"]["box1"]["address"] = fleet["workstations"]["desk"]["address"] = "127.0.0.1"
    fleet["workstations"]["desk"]["port"] = 2222
    _refused(tmp_path, fleet, "box 'box1' has no api_key", "set api_key")


def test_duplicate_addresses_and_names_are_refused(tmp_path):
    fleet = _fleet(tmp_path)
    fleet["workstations"]["desk2"] = copy.deepcopy(fleet["workstations"]["desk"])
    _refused(tmp_path, fleet, "workstation 'desk2' and workstation 'desk' share the address 192.0.2.50:22")
    fleet = _fleet(tmp_path)
    fleet["workstations"]["desk"]["address"] = "192.0.2.7"
    _refused(tmp_path, fleet, "workstation 'desk' and box 'box1' share the address")
    fleet = _fleet(tmp_path)
    fleet["workstations"]["box2"] = fleet["workstations"].pop("desk")
    _refused(tmp_path, fleet, "workstation 'box2' has the name of a box")


def test_a_box_the_workstation_cannot_reach_is_refused(tmp_path):
    fleet = _fleet(tmp_path)
    fleet["boxes"]["box1"]["bind"] = "127.0.0.1"
    _refused(tmp_path, fleet, "box 'box1' binds 127.0.0.1, which only the box itself reaches")
    fleet["workstations"]["desk"] |= {"address": "192.0.2.7", "port": 2222}  # the box's own network stack
    assert _load(tmp_path, fleet).workstation("desk").boxes == ["box1"]
    fleet = _fleet(tmp_path)
    fleet["boxes"]["box1"]["allow_from"] = ["198.51.100.0/24"]
    _refused(tmp_path, fleet, "accepts connections only from 198.51.100.0/24", "not from 192.0.2.50")


def test_bad_workstation_fields_name_the_workstation(tmp_path):
    fleet = _fleet(tmp_path)
    fleet["workstations"]["desk"]["accounts"] = ["al ice"]
    _refused(tmp_path, fleet, "workstation 'desk'", "account 'al ice'")
    fleet = _fleet(tmp_path)
    fleet["workstations"]["desk"]["models"] = [{"id": GATE}]
    _refused(tmp_path, fleet, "workstation 'desk'", "'models'", "unknown field")
    fleet = _fleet(tmp_path)
    fleet["workstations"]["desk"]["boxes"] = []
    _refused(tmp_path, fleet, "workstation 'desk'", "'boxes'")


def test_rendered_inventory_carries_the_services_but_never_a_key(tmp_path):
    body = _fleet(tmp_path)
    body["workstations"]["desk"]["boxes"] = ["box1", "box2"]
    fleet = _load(tmp_path, body)
    _plan(tmp_path, "box1")
    _plan(tmp_path, "box2", model=SMALL)
    inventory = tmp_path / "inventory"
    written = render_workstation(inventory, fleet, fleet.workstation("desk"))
    host_vars = read_rendered((inventory / "host_vars" / "desk.yml").read_text())
    services = host_vars["agent_clients_services"]
    assert [(s["box"], s["key"]) for s in services] == [("box1", "box1"), ("box2", "box2")]
    assert services[0]["env"]["ANTHROPIC_BASE_URL"].startswith("http://192.0.2.7:")  # the box's address, not loopback
    assert "ANTHROPIC_AUTH_TOKEN" not in services[0]["env"] and "apiKey" not in services[0]["openclaw_provider"]
    assert host_vars["agent_clients_users"] == ["alice", "bob"]
    for path in written:
        assert KEY not in path.read_text() and OTHER_KEY not in path.read_text()
    hosts = read_rendered(Inventory(inventory).workstations_file.read_text())
    desk = hosts["all"]["children"]["workstations"]["hosts"]["desk"]
    assert desk["ansible_host"] == "192.0.2.50" and desk["ansible_user"] == "ops"
    assert "StrictHostKeyChecking=yes" in desk["ansible_ssh_common_args"]
    assert "box1" not in hosts["all"]["children"]["workstations"]["hosts"]  # boxes stay in hosts.yml
    assert workstation_secrets(fleet, fleet.workstation("desk")) == {"agent_clients_keys": {"box1": KEY, "box2": OTHER_KEY}}


def test_two_boxes_serving_one_model_would_share_a_launch_script(tmp_path):
    body = _fleet(tmp_path)
    body["workstations"]["desk"]["boxes"] = ["box1", "box2"]
    fleet = _load(tmp_path, body)
    _plan(tmp_path, "box1")
    _plan(tmp_path, "box2")
    with pytest.raises(FleetError, match=f"boxes box1 and box2 both serve {GATE}.*claude-{GATE}"):
        workstation_vars(fleet, fleet.workstation("desk"), tmp_path / "inventory")


def test_a_box_without_a_rendered_plan_is_named(tmp_path):
    fleet = _load(tmp_path, _fleet(tmp_path))
    with pytest.raises(NotRendered, match="has no plan for box1: .*; run `controller provision box1`"):
        workstation_vars(fleet, fleet.workstation("desk"), tmp_path / "inventory")


def test_provision_of_a_workstation_refuses_bad_input_in_one_line_before_any_connection(tmp_path):
    body = _fleet(tmp_path)
    (tmp_path / "box1.key").write_text("short\n")
    _plan(tmp_path, "box1")
    done = run_controller("provision", "desk", "--fleet", str(_write(tmp_path, body)), timeout=60)
    assert_one_line_error(done, 2, "box box1 api_key", "16 to 256 printable ASCII characters")
    assert not Inventory(tmp_path / "inventory").workstations_file.exists()  # nothing half-written
    body["workstations"]["desk"]["os"] = "windows"
    done = run_controller("provision", "desk", "--fleet", str(_write(tmp_path, body)), timeout=60)
    assert_one_line_error(done, 2, "workstation desk: Windows workstations are not wired yet")
