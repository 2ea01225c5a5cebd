"""The inventory folder's one owner (controller/inventory.py): where each artefact lives, the typed readers and their
one "never rendered" error, the writers, and where a box's engines live."""

from __future__ import annotations

import json

import pytest
import yaml

from controller.errors import NotRendered
from controller.inventory import ENGINE_ROLE_VARS, Inventory, role_engine_roots
from controller.model.fleet import WantedModel
from controller.model.profile import Cpu, HardwareProfile, OsInfo
from controller.stages.planner import plan_models
from tests.cli import invoke
from tests.unit.planner.helpers import CPU_ONLY, catalog, profile

MODEL = "qwen2.5-coder-0.5b-instruct-q8_0"


def test_the_layout_is_the_one_the_readme_documents(tmp_path):
    folder = Inventory(tmp_path)
    assert [path.relative_to(tmp_path).as_posix() for path in (
        folder.hosts_file, folder.workstations_file, folder.host_vars_file("box1"), folder.probe_file("box1"),
        folder.plan_file("box1"), *folder.report_files("box1"), folder.known_hosts_file, folder.artifacts_folder,
        folder.facts_folder, folder.mutex_file, folder.run_mutex_file)] == [
        "hosts.yml", "workstations.yml", "host_vars/box1.yml", "probes/box1.json", "plans/box1.json",
        "reports/box1.json", "reports/box1.md", "known_hosts", "artifacts", "facts", ".lock", ".run.lock"]
    assert {kind: path.name for kind, path in folder.certify_files("box1").items()} == {
        "markdown": "box1.certify.md", "json": "box1.certify.json", "html": "box1.certify.html",
        "pdf": "box1.certify.pdf"}
    assert Inventory.beside(tmp_path / "fleet.yml").root == tmp_path.resolve() / "inventory"


def test_a_plan_reads_back_as_written_and_a_missing_one_is_the_one_never_rendered_error(tmp_path):
    folder = Inventory(tmp_path / "inventory")
    assert folder.find_plan("box1") is None
    with pytest.raises(NotRendered) as missing:
        folder.plan("box1")
    assert str(missing.value) == (f"{folder.root} has no plan for box1: the box was never provisioned from this "
                                  "inventory; run `controller provision box1` (or `controller render box1`) first")
    assert missing.value.exit_code == 1

    plan = plan_models([WantedModel(id=MODEL)], profile(CPU_ONLY), catalog())
    folder.write_plan("box1", plan)
    assert folder.plan("box1") == plan and folder.find_plan("box1") == plan
    folder.remove_plan("box1")
    assert folder.find_plan("box1") is None


def test_a_damaged_plan_names_its_file_and_the_command_that_writes_it_again(tmp_path):
    folder = Inventory(tmp_path)
    folder.plan_file("box1").parent.mkdir()
    folder.plan_file("box1").write_text('{"services": "not a list"}')
    with pytest.raises(NotRendered, match=r"plans/box1.json is not a plan this controller wrote \(.*\); run "
                                          r"`controller render box1` again"):
        folder.find_plan("box1")


def test_one_damaged_probe_is_left_out_of_the_others_with_a_warning(tmp_path):
    folder = Inventory(tmp_path)
    good = HardwareProfile(cpu=Cpu(model="EPYC", cores=2, threads=4), memory_mib=8192, os=OsInfo(family="linux"))
    folder.write_probe("good", good)
    folder.probe_file("bad").write_text("{")
    said: list[str] = []
    assert folder.probes(said.append) == {"good": good}
    assert folder.probe("good") == good and folder.probe("bad") is None and folder.probe("never") is None
    (line,) = said
    assert "probes/bad.json" in line and "`controller render bad` probes it again" in line


def test_reports_are_read_as_written_and_a_seal_is_read_from_the_certification_report(tmp_path):
    folder = Inventory(tmp_path)
    assert folder.report("box1") is None and folder.certify_report("box1") is None and folder.sealed_at("box1") is None
    json_path, md_path = folder.write_report({"box": "box1", "verified": True}, "# Box box1\n")
    assert folder.report("box1") == {"box": "box1", "verified": True} and md_path.read_text() == "# Box box1\n"
    assert json_path == folder.report_files("box1")[0]
    certify = folder.certify_files("box1")["json"]
    certify.write_text(json.dumps({"box": "box1", "seal": {"sealed_at": "2026-11-24T03:30:00+00:00"}}))
    assert folder.sealed_at("box1") == "2026-11-24T03:30:00+00:00"


def test_the_engine_root_is_the_rendered_one_or_the_llama_engine_roles_own(tmp_path):
    role = yaml.safe_load(ENGINE_ROLE_VARS.read_text())["_llama_engine_os_defaults"]
    assert role_engine_roots() == {False: role[False]["root"], True: role[True]["root"]}
    folder = Inventory(tmp_path)
    assert folder.engine_root("box1") == role[False]["root"]
    assert folder.engine_root("win", windows=True) == role[True]["root"]
    folder.write_host_vars("box1", "llama_engine_root: /srv/engines\n")
    assert folder.engine_root("box1") == "/srv/engines"
    folder.write_host_vars("box2", "llama_engine_root: !unsafe '{{ somewhere }}'\n")  # templated: the role decides
    assert folder.engine_root("box2") == role[False]["root"]


def test_the_commands_that_need_a_rendered_box_say_so_in_one_line_with_exit_1(tmp_path):
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(yaml.safe_dump({"boxes": {"box1": {"address": "192.0.2.7", "api_key": {"env": "NO_SUCH_KEY"},
                                                        "models": [{"id": MODEL}]}}}))
    for command, words in ((["clients"], "has no plan for box1"), (["verify"], "has no rendered inventory for box1")):
        done = invoke(*command, "box1", "--fleet", str(fleet))
        assert done.exit_code == NotRendered.exit_code == 1, done.output
        (line,) = done.stderr.strip().splitlines()
        assert words in line and "controller render box1" in line
