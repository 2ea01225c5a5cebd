"""The provision use case called from Python (controller/actions/provision.py): one pipeline for one box or many,
which guards the fleet's lock before it touches a box and records in it what the boxes that ran now have.

The machine is faked at its two edges only: the probe finds a small CPU box, and the Ansible run (the runner's one
call) answers with each host's stats. Everything between them is real: the catalog, the planner, render into the
inventory, the reports and the lock file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.actions.fleetrun import FAILED, NOT_VERIFIED, UNREACHABLE
from controller.actions.lock import lock_path, read_lock
from controller.actions.provision import provision
from controller.errors import LockError, TransportError
from controller.inventory import Inventory
from controller.model.catalog import load_catalog
from controller.model.fleet import load_fleet
from controller.model.profile import Cpu, Driver, HardwareProfile, OsInfo
from controller.stages.runner import FailedTask, HostStats, RunResult
from controller.stages.strategy import LINEAR, MITOGEN
from tests.unit.test_verify import RECORDED

SHA = "cd" * 32
PACK_SHA = "ab" * 32
ENGINE = "cpu-0c1e570"
PROFILE = HardwareProfile(cpu=Cpu(model="EPYC", cores=2, threads=4), memory_mib=8192, os=OsInfo(family="linux"),
                          driver=Driver(version="580.82.07"))


def write_fleet(folder: Path, boxes: tuple[str, ...] = ("box1", "box2"), ctx: int = 2048, sha256: str = SHA) -> Path:
    """A fleet of CPU boxes wanting one tiny model, from a plain-HTTP mirror whose files the catalog pins."""
    engine = load_catalog().engine(ENGINE).model_dump(mode="json", exclude={"id"}, exclude_none=True)
    engine["packs"]["linux-x86_64"]["sha256"] = PACK_SHA
    (folder / "catalog.yml").write_text(yaml.safe_dump({
        "models": {"tiny": {"name": "t", "repo": "lab/r", "file": "t.gguf", "size_bytes": 1000, "sha256": sha256,
                            "engine": "upstream"}},
        "engines": {ENGINE: engine}}))
    mirror = {"engines": "http://192.0.2.99/engines", "models": "http://192.0.2.99"}
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump({"catalogs": ["catalog.yml"], "boxes": {
        name: {"address": f"192.0.2.{i + 10}", "models": [{"id": "tiny", "ctx": ctx}], "base_port": 18080,
               "mirror": mirror} for i, name in enumerate(boxes)}}))
    return path


@pytest.fixture
def machine(monkeypatch):
    """The probe and the Ansible run replaced; ``runs`` records each run, ``down`` names boxes that do not answer the
    probe, ``failing`` boxes whose run fails, ``answering`` boxes whose servers pass the run's checks."""
    state: dict[str, Any] = {"runs": [], "down": set(), "failing": set(), "answering": set()}

    def probe_box(box, transport=None, *, known_hosts=None):
        if box.name in state["down"]:
            raise TransportError(f"box {box.name} ({box.address}:22): cannot connect")
        return PROFILE, {}, 0.1

    def run_playbook(playbook, *, inventory, limit, **kwargs):
        hosts = limit.split(",")
        state["runs"].append({"playbook": playbook, "hosts": hosts, **kwargs})
        failing = [host for host in hosts if host in state["failing"]]
        answers = {host: {service.name: {**RECORDED["llama-tiny"], "model": service.model, "port": service.port,
                                         "served_ids": [service.model]}
                          for service in Inventory(inventory).plan(host).services}
                   for host in hosts if host in state["answering"]}
        return RunResult(playbook, "failed" if failing else "successful", 2 if failing else 0, 3.0,
                         stats={host: HostStats(ok=9, changed=2, failures=int(host in failing)) for host in hosts},
                         failed=[FailedTask(host, "Install engine", "no space left") for host in failing],
                         data={"llama_verify": answers})

    monkeypatch.setattr("controller.stages.probe.collect.probe_box", probe_box)
    monkeypatch.setattr("controller.actions.provision.run_playbook", run_playbook)
    return state


def test_provisioning_from_python_records_the_boxes_that_ran_in_the_fleet_lock(tmp_path, machine):
    fleet_path = write_fleet(tmp_path)
    inventory = tmp_path / "inventory"
    done = provision(load_fleet(fleet_path), ["box1"], inventory, fleet_path=fleet_path)
    assert [(one.box, one.result) for one in done.outcomes] == [("box1", NOT_VERIFIED)]  # the fake run checks nothing
    assert done.lock_file == lock_path(fleet_path) and done.lock_changes == ["box1: added"]
    lock = read_lock(lock_path(fleet_path))
    assert set(lock.boxes) == {"box1"} and lock.boxes["box1"].driver.installed == "580.82.07"
    assert lock.boxes["box1"].engines[ENGINE].sha256 == PACK_SHA and lock.boxes["box1"].models["t.gguf"].sha256 == SHA
    assert Inventory(inventory).plan("box1").services[0].name in lock.boxes["box1"].services  # what was rendered
    assert provision(load_fleet(fleet_path), ["box1"], inventory, fleet_path=fleet_path).lock_changes == []

    write_fleet(tmp_path, ctx=4096)
    again = provision(load_fleet(fleet_path), ["box1", "box2"], inventory, fleet_path=fleet_path)
    assert again.lock_changes[0].startswith("box1: the fleet's models for the box is now")
    assert "box2: added" in again.lock_changes and set(read_lock(lock_path(fleet_path)).boxes) == {"box1", "box2"}
    assert [run["hosts"] for run in machine["runs"]] == [["box1"], ["box1"], ["box1", "box2"]]  # one run for both


def test_without_a_fleet_file_nothing_is_read_or_written_of_a_lock(tmp_path, machine):
    fleet_path = write_fleet(tmp_path)
    done = provision(load_fleet(fleet_path), ["box1"], tmp_path / "inventory")
    assert done.lock_file is None and done.lock_changes is None and not lock_path(fleet_path).exists()
    assert done.reports["box1"]["box"] == "box1" and Path(done.outcomes[0].report).is_file()


def test_a_box_that_failed_stays_out_of_the_lock_and_the_run_goes_on_without_one_that_is_down(tmp_path, machine):
    fleet_path = write_fleet(tmp_path, boxes=("box1", "box2", "box3"))
    machine["down"].add("box2")
    machine["failing"].add("box3")
    done = provision(load_fleet(fleet_path), ["box1", "box2", "box3"], tmp_path / "inventory", fleet_path=fleet_path)
    assert [(one.box, one.result) for one in done.outcomes] == [("box1", NOT_VERIFIED), ("box2", UNREACHABLE),
                                                                 ("box3", FAILED)]
    assert done.outcomes[1].reason == "box box2 (192.0.2.11:22): cannot connect"
    assert done.outcomes[2].reason == "task 'Install engine' failed: no space left"
    assert machine["runs"][0]["hosts"] == ["box1", "box3"] and machine["runs"][0]["forks"] == 2
    assert done.lock_changes == ["box1: added"] and set(read_lock(lock_path(fleet_path)).boxes) == {"box1"}


def test_raise_failures_makes_the_first_failure_the_callers_error(tmp_path, machine):
    fleet_path = write_fleet(tmp_path)
    machine["down"].add("box1")
    with pytest.raises(TransportError, match="box box1 .*cannot connect"):
        provision(load_fleet(fleet_path), ["box1"], tmp_path / "inventory", fleet_path=fleet_path, raise_failures=True)
    assert machine["runs"] == [] and not lock_path(fleet_path).exists()


def test_a_locked_provision_refuses_any_difference_before_a_box_is_rendered_or_run(tmp_path, machine):
    fleet_path = write_fleet(tmp_path)
    inventory = tmp_path / "inventory"
    with pytest.raises(LockError, match="has no lock"):
        provision(load_fleet(fleet_path), ["box1"], inventory, fleet_path=fleet_path, locked=True)
    provision(load_fleet(fleet_path), ["box1"], inventory, fleet_path=fleet_path)  # writes box1's entry
    written = lock_path(fleet_path).read_text()
    rendered = Inventory(inventory).host_vars_file("box1").read_bytes()

    with pytest.raises(LockError, match="box box2 is not in"):
        provision(load_fleet(fleet_path), ["box1", "box2"], inventory, fleet_path=fleet_path, locked=True)
    write_fleet(tmp_path, sha256="ef" * 32)  # the catalog now pins another file
    with pytest.raises(LockError, match="box box1: model file t.gguf: sha256 is now efefefefefef…"):
        provision(load_fleet(fleet_path), ["box1"], inventory, fleet_path=fleet_path, locked=True)
    assert len(machine["runs"]) == 1 and lock_path(fleet_path).read_text() == written
    assert Inventory(inventory).host_vars_file("box1").read_bytes() == rendered

    write_fleet(tmp_path)
    done = provision(load_fleet(fleet_path), ["box1"], inventory, fleet_path=fleet_path, locked=True)
    assert done.outcomes[0].result == NOT_VERIFIED and len(machine["runs"]) == 2
    assert done.lock_changes is None and lock_path(fleet_path).read_text() == written  # --locked records nothing


def test_another_fleets_lock_is_refused_before_any_connection(tmp_path, machine):
    fleet_path = write_fleet(tmp_path)
    provision(load_fleet(fleet_path), ["box1"], tmp_path / "inventory", fleet_path=fleet_path)
    other = tmp_path / "other.yml"
    other.write_text(fleet_path.read_text())
    lock_path(other).write_text(lock_path(fleet_path).read_text())
    machine["down"].update({"box1", "box2"})  # a connection would fail differently
    with pytest.raises(LockError, match="was written for fleet file fleet.yml"):
        provision(load_fleet(other), ["box1"], tmp_path / "inventory", fleet_path=other)


def test_a_run_goes_under_mitogen_when_a_box_is_expected_to_run_every_role(tmp_path, machine):
    """controller/stages/strategy.py: mitogen for a box with no run that ended ok, changed inputs or --full; linear
    when every box is expected to end after the converged comparison; a failed run forgets the box."""
    fleet_path = write_fleet(tmp_path)
    inventory = tmp_path / "inventory"
    machine["answering"] |= {"box1", "box2"}

    def strategy(names=("box1",), **options):
        done = provision(load_fleet(fleet_path), list(names), inventory, **options)
        assert machine["runs"][-1]["strategy"] == done.strategy.strategy == done.as_dict()["strategy"]["name"]
        return done.strategy

    first = strategy()
    assert first.strategy == MITOGEN and first.reason == ("box1 has no run that ended ok on record: every role is "
                                                          "expected to run")
    again = strategy()
    assert again.strategy == LINEAR and "expected to match the record of its last full run" in again.reason
    assert strategy(full=True).strategy == MITOGEN
    assert strategy(("box1", "box2")).reason.startswith("box2 has no run")  # one box's full run is the run's

    write_fleet(tmp_path, ctx=4096)  # a new plan: the box runs every role
    changed = strategy()
    assert changed.strategy == MITOGEN and changed.reason == ("box1's rendered inputs or recorded host key changed "
                                                              "since its last run that ended ok: every role is "
                                                              "expected to run")
    assert strategy().strategy == LINEAR
    # The box was replaced by a new machine at its address: its new host key is recorded, the plan is the same.
    import paramiko

    from controller.stages.transports.known_hosts import record
    record(Inventory(inventory).known_hosts_file, "192.0.2.10", paramiko.RSAKey.generate(1024))
    assert strategy().reason.startswith("box1's rendered inputs or recorded host key changed")
    assert strategy().strategy == LINEAR

    machine["failing"].add("box1")
    assert strategy().strategy == LINEAR
    machine["failing"].clear()
    assert strategy().strategy == MITOGEN  # the failed run left no record: its rerun may run every role
    machine["answering"].clear()
    assert strategy().strategy == LINEAR
    assert strategy().strategy == MITOGEN  # its checks failed: not recorded either


@pytest.mark.parametrize(("entry", "why"), [
    ({"transport": "winrm", "os": "windows", "user": "Administrator"}, "box1 is reached over winrm"),
    ({"transport": "local"}, "box1 is reached over local"),
    ({"user": "builder"}, "box1 logs in as builder, not root"),
    ({"password": {"env": "BOX_PASSWORD"}}, "box1 logs in with a password"),
    ({"vars": {"ansible_ssh_host_key_checking": False}}, "box1 sets ansible_ssh_host_key_checking in its vars"),
    ({"vars": {"ansible_host_key_checking": False}}, "box1 sets ansible_host_key_checking in its vars"),
])
def test_a_box_mitogen_is_not_proven_on_keeps_the_run_linear(tmp_path, entry, why):
    from controller.model.fleet import parse_fleet
    from controller.stages.strategy import choose

    box = parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", **entry}}}, tmp_path / "fleet.yml").box("box1")
    other = parse_fleet({"boxes": {"box2": {"address": "127.0.0.2"}}}, tmp_path / "fleet.yml").box("box2")
    for boxes in ([box], [other, box]):
        choice = choose(boxes, {}, {}, full=True)
        assert (choice.strategy, choice.reason) == (LINEAR, why)
    assert choose([other], {}, {}, full=True).strategy == MITOGEN
