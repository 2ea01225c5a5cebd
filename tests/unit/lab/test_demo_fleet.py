"""`controller demo --boxes N`: the fleet file of N demo boxes, and which containers `--down` removes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from controller.fleet import load_fleet
from lab import demo


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
