"""`controller demo --boxes N`: the fleet file of N demo boxes (each with its own key), the lock it writes, the boxes
a later run removes (and says so), and which containers `--down` removes."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from controller.model.catalog import load_catalog
from controller.model.fleet import load_fleet
from controller.model.profile import Cpu, HardwareProfile, OsInfo
from controller.stages.planner import plan_box
from lab import demo
from lab.site import PACK_NAME
from tests.cli import invoke


@dataclass
class FakeTarget:
    """What write_fleet reads of a started target (a real one needs podman: the integration tests have it)."""

    ssh_port: int
    host: str = "127.0.0.1"
    user: str = "root"
    key: Path = Path("/keys/id_ed25519")

    def host_public_key(self) -> str:
        return "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOf0k3S0t2f4m8cJ9v8u3l7p0d2xS1y5b3q0w9e8r7t6"


class FakeServer:
    url = "http://127.0.0.1:9999"


def test_n_demo_boxes_share_one_fleet_file_each_with_its_own_ports(tmp_path):
    path = demo.write_fleet(tmp_path, [FakeTarget(2201), FakeTarget(2202), FakeTarget(2203)], FakeServer(),
                            tmp_path / "catalog.yml")
    fleet = load_fleet(path)
    assert list(fleet.boxes) == ["demo", "demo2", "demo3"] and fleet.groups == {"demo-boxes": ["demo", "demo2", "demo3"]}
    assert [box.base_port for box in fleet.boxes.values()] == [18080, 18090, 18100]
    assert fleet.select([], everything=True) == ["demo", "demo2", "demo3"]


def test_each_demo_box_has_its_own_api_key(tmp_path):
    fleet = load_fleet(demo.write_fleet(tmp_path, [FakeTarget(2201), FakeTarget(2202)], FakeServer(),
                                        tmp_path / "catalog.yml"))
    files = [box.api_key.file for box in fleet.boxes.values()]
    assert files == [tmp_path / "api.key", tmp_path / "api-demo2.key"]
    keys = [file.read_text() for file in files]
    assert keys[0] != keys[1] and all(len(key.strip()) >= 32 and file.stat().st_mode & 0o777 == 0o600
                                      for key, file in zip(keys, files))
    again = load_fleet(demo.write_fleet(tmp_path, [FakeTarget(2201), FakeTarget(2202)], FakeServer(),
                                        tmp_path / "catalog.yml"))
    assert [box.api_key.file.read_text() for box in again.boxes.values()] == keys  # made once, then kept


def test_one_demo_box_is_the_fleet_file_the_readme_shows(tmp_path):
    path = demo.write_fleet(tmp_path, FakeTarget(2201), FakeServer(), tmp_path / "catalog.yml")
    raw = yaml.safe_load(path.read_text())
    assert list(raw) == ["catalogs", "boxes"] and list(raw["boxes"]) == ["demo"]
    assert raw["boxes"]["demo"]["base_port"] == demo.DEMO_PORT


def test_down_removes_every_demo_container_and_nothing_else(monkeypatch):
    @dataclass
    class Record:
        name: str

    names = ["v100box-demo", "v100box-demo2", "v100box-demo12", "v100box-demox", "v100box-statusdev", "other"]
    monkeypatch.setattr(demo.lab_target, "list_targets", lambda: [Record(name) for name in names])
    removed: list[str] = []
    monkeypatch.setattr(demo.lab_target, "remove_containers", lambda chosen: removed.extend(chosen))
    assert demo.teardown() == ["v100box-demo", "v100box-demo12", "v100box-demo2"]
    assert removed == ["v100box-demo", "v100box-demo12", "v100box-demo2"]
    assert [demo.container_name(i) for i in (1, 2)] == ["v100box-demo", "v100box-demo2"]


# ---------------------------------------------------------------- `controller demo`: the lock and a smaller fleet


@pytest.fixture
def demo_machine(tmp_path, monkeypatch):
    """`controller demo` in this process with the machine faked at its edges: containers are names in a list, the
    download site is the lab's real one (its catalog and models; a stand-in engine pack, nothing runs it), the probe
    finds a small CPU box, render writes each box's real plan and probe into the inventory, and the run reports
    every box verified. The provision use case between those edges, the fleet lock's record included, is real."""
    from controller.actions import provision
    from controller.stages.runner import RunResult

    folder = tmp_path / "demo"
    (folder / "site" / "engines").mkdir(parents=True)
    (folder / "site" / "engines" / PACK_NAME).write_bytes(b"a stand-in pack: nothing runs it here")
    running: list[str] = []
    monkeypatch.setattr(demo, "demo_dir", lambda: folder)
    monkeypatch.setattr(demo, "demo_containers", lambda: sorted(running))
    monkeypatch.setattr(demo.lab_target, "remove_containers", lambda names: [running.remove(n) for n in names])

    def start(name):
        running.append(name) if name not in running else None
        return FakeTarget(2200 + demo.box_index(demo.box_of(name)))

    monkeypatch.setattr(demo, "demo_target", start)
    monkeypatch.setattr(demo, "site_server", lambda folder: contextlib.nullcontext(FakeServer()))
    hardware = HardwareProfile(cpu=Cpu(cores=2, threads=2), memory_mib=8192, os=OsInfo(family="linux"))

    def render_box(inventory, fleet, box, profile, plan):
        assert plan == plan_box(box, hardware, load_catalog(fleet.catalogs))
        for kind, body in (("plans", plan), ("probes", profile)):
            (inventory / kind).mkdir(parents=True, exist_ok=True)
            (inventory / kind / f"{box.name}.json").write_text(body.model_dump_json())

    def finish(item, run, seconds, inventory, outcome):
        outcome.result, outcome.verified = "ok", True
        return {"box": item.box.name, "verified": True, "services": []}

    monkeypatch.setattr("controller.stages.probe.collect.probe_box",
                        lambda box, known_hosts=None: (hardware, {}, 0.1))
    monkeypatch.setattr(provision, "render_box", render_box)
    monkeypatch.setattr(provision, "run_playbook", lambda playbook, **_run: RunResult(playbook, "successful", 0, 0.1))
    monkeypatch.setattr(provision, "finish", finish)
    return folder, running


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _locked(folder: Path) -> list[str]:
    return sorted(yaml.safe_load((folder / "fleet.lock.yml").read_text())["boxes"])


def test_demo_boxes_go_into_the_lock_and_a_smaller_run_says_what_it_removed(demo_machine):
    folder, running = demo_machine
    grown = invoke("demo", "--boxes", "3", "--json")
    assert grown.exit_code == 0, grown.output
    assert _locked(folder) == ["demo", "demo2", "demo3"] and running == [demo.container_name(i) for i in (1, 2, 3)]
    (lock,) = [line for line in _lines(grown.stdout) if line["type"] == "lock"]
    assert lock["changes"] == ["demo: added", "demo2: added", "demo3: added"]

    fewer = invoke("demo", "--boxes", "2")  # the words a person reads
    assert fewer.exit_code == 0, fewer.output
    assert ("Removed demo box demo3 (left from an earlier `controller demo --boxes N`): the fleet file now names "
            "demo, demo2") in fewer.stdout
    assert "demo3: removed (the fleet no longer names it)" in fewer.stdout
    assert _locked(folder) == ["demo", "demo2"]

    plain = invoke("demo", "--json")
    assert plain.exit_code == 0, plain.output
    lines = _lines(plain.stdout)
    assert {"type": "removed", "boxes": ["demo2"], "fleet": ["demo"]} in lines
    (lock,) = [line for line in lines if line["type"] == "lock"]
    assert lock["changes"] == ["demo2: removed (the fleet no longer names it)"]
    assert _locked(folder) == ["demo"] and running == [demo.DEMO_NAME]
    assert list(yaml.safe_load((folder / "fleet.yml").read_text())["boxes"]) == ["demo"]


def test_the_demo_site_keeps_its_port_while_it_is_free(tmp_path):
    """The site's address is one of the demo box's inputs: a rerun serves on the same port, so the box can take the
    converged fast path; a port taken since gives way to a new one, remembered for the next run."""
    import socket

    from lab.demo import site_server

    (tmp_path / "site").mkdir()
    with site_server(tmp_path) as first:
        port = first.port
    with site_server(tmp_path) as again:
        assert again.port == port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with site_server(tmp_path) as moved:
            assert moved.port != port
    assert (tmp_path / "site-port").read_text() == f"{moved.port}\n"
