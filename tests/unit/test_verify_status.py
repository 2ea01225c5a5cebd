"""controller status: one box's answers, its plan and its lock entry become services and drift (pure), the JSON
contract, the exit codes, and the human table."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from controller.actions.lock import BoxLock, LockedEngine, LockedModel, LockedService
from controller.cli.status import human
from controller.model.fleet import parse_fleet
from controller.model.serveplan import Download, EnginePack, ModelFile, ServePlan, Service, ServiceMemory
from controller.stages.verify.status import (
    EXIT_DRIFT,
    EXIT_OK,
    EXIT_UNHEALTHY,
    EXIT_UNREACHABLE,
    BoxStatus,
    box_status,
    exit_code,
    to_json,
)

UNIT = "/etc/systemd/system/llama-tiny-llama.service"
ENV = "/etc/llama/llama-tiny-llama.env"
MODEL = "/var/lib/llama/models/tiny-llama-128k-q8_0.gguf"
SHA = "568be0e642b046c09ac45bc9e50ce72b7af08ff5f615c3fc19e22e6a16520bb2"
FLEET = "fleet.yml"

# What roles/llama_verify tasks/status.yml published (set_stats llama_status) for a converged lab box with the
# stand-in nvidia-smi of tests/fixtures/probe/single-v100-16g-linux (recorded from a run on the lab target;
# memory.used added, the capture has none).
ANSWERS: dict[str, Any] = {
    "units": {"llama-tiny-llama": {"load": "loaded", "active": "active", "sub": "running", "enabled": "enabled",
                                   "fragment": UNIT, "drop_ins": [], "need_reload": False}},
    "files": {MODEL: {"exists": True, "size": 127776, "mtime_ns": 1795478912401202227, "inode": 1630545, "uid": 0,
                      "marker": {"sha256": SHA, "size": 127776, "mtime_ns": 1795478912401202227, "inode": 1630545,
                                 "uid": 0},
                      "matches": True}},
    "links": {"/opt/llama/cpu/current": "0c1e570"},
    "gpus": [{"index": 0, "name": "Tesla V100-SXM2-16GB", "driver_version": "570.172.08", "temperature_c": 41,
              "memory_used_mib": 15100, "memory_total_mib": 16384}],
    "gpu_error": "",
    "checksums": {UNIT: "f5ee2fce3e778151d9db22afd1e533da46321f53", ENV: "15062ec12da5e642a2b0fb64c5e03d43b80d9cf0"},
    "expected_checksums": {UNIT: "f5ee2fce3e778151d9db22afd1e533da46321f53",
                           ENV: "15062ec12da5e642a2b0fb64c5e03d43b80d9cf0"},
    "servers": {"llama-tiny-llama": {"health": "ok", "served_ids": ["tiny-llama"], "error": ""}},
}


def plan() -> ServePlan:
    engine = EnginePack(id="cpu-0c1e570", slot="cpu", commit="0c1e570", family="upstream", platform="linux-x86_64",
                        download=Download(id="cpu-0c1e570", version="0c1e570", file="llama-cpu.tar.gz"))
    service = Service(name="llama-tiny-llama", model="tiny-llama", model_file="tiny-llama-128k-q8_0.gguf",
                      engine="cpu-0c1e570", ctx=2048, port=18080, gpus=[0], args=["--port", "18080"],
                      memory=ServiceMemory(per_device_mib={"cuda0": 14900}))
    return ServePlan(fits=True, services=[service], engines=[engine], model_dir="/var/lib/llama/models",
                     models=[ModelFile(id="tiny-llama", file="tiny-llama-128k-q8_0.gguf", sha256=SHA,
                                       size_bytes=127776)])


def box(tmp_path: Path):
    return parse_fleet({"boxes": {"lab1": {"address": "127.0.0.1"}}}, tmp_path / FLEET).box("lab1")


def status_of(tmp_path: Path, answers: dict[str, Any] | None = None, **kwargs: Any) -> BoxStatus:
    return box_status(box(tmp_path), kwargs.pop("the_plan", plan()), ANSWERS if answers is None else answers,
                      fleet_path=FLEET, **kwargs)


def changed(**edits: Any) -> dict[str, Any]:
    answers = copy.deepcopy(ANSWERS)
    for path, value in edits.items():
        where = answers
        keys = path.split(".")
        for key in keys[:-1]:
            where = where[key]
        where[keys[-1]] = value
    return answers


def whats(status: BoxStatus) -> list[str]:
    return [drift.what for drift in status.drift]


def test_a_converged_box_is_healthy_without_drift_and_prints_the_contract(tmp_path):
    status = status_of(tmp_path)
    assert status.healthy and status.drift == [] and exit_code([status]) == EXIT_OK
    data = to_json([status])
    assert data["exit_code"] == 0
    (entry,) = data["boxes"]
    assert {"name", "reachable", "services", "drift"} <= set(entry)
    assert entry["name"] == "lab1" and entry["reachable"] is True
    (service,) = entry["services"]
    assert {key: service[key] for key in ("model", "port", "active", "healthy", "served_model")} == {
        "model": "tiny-llama", "port": 18080, "active": True, "healthy": True, "served_model": "tiny-llama"}
    assert entry["engines"] == [{"id": "cpu-0c1e570", "slot": "cpu", "planned": "0c1e570", "running": "0c1e570",
                                 "locked": None}]
    assert entry["gpus"][0]["memory_planned_mib"] == 14900 and entry["gpus"][0]["memory_used_mib"] == 15100
    text = human(status)
    assert "lab1: healthy, no drift" in text and "15100/16384 MiB used (planned 14900)" in text


def test_a_unit_edited_by_hand_is_drift_with_the_command_that_rewrites_it(tmp_path):
    status = status_of(tmp_path, changed(**{"checksums": {**ANSWERS["checksums"], UNIT: "0" * 40}}))
    (drift,) = status.drift
    assert drift.what == "unit-edited" and UNIT in drift.detail
    assert drift.fix.startswith(f"controller provision lab1 --fleet {FLEET}")
    assert status.healthy and exit_code([status]) == EXIT_DRIFT
    assert "drift unit-edited" in human(status) and "fix: controller provision lab1" in human(status)


def test_an_edited_environment_file_and_a_drop_in_are_drift(tmp_path):
    status = status_of(tmp_path, changed(**{"checksums": {**ANSWERS["checksums"], ENV: None},
                                            "units.llama-tiny-llama.drop_ins": ["/etc/systemd/system/x.d/o.conf"]}))
    assert whats(status) == ["env-edited", "unit-drop-in"]
    assert "systemctl revert llama-tiny-llama.service" in status.drift[1].fix


def test_a_stopped_and_disabled_service_is_unhealthy_and_drift(tmp_path):
    answers = changed(**{"units.llama-tiny-llama.active": "inactive", "units.llama-tiny-llama.sub": "dead",
                         "units.llama-tiny-llama.enabled": "disabled",
                         "servers.llama-tiny-llama": {"health": "unreachable", "served_ids": [],
                                                      "error": "http://127.0.0.1:18080: /health: refused"}})
    status = status_of(tmp_path, answers)
    assert whats(status) == ["service-stopped", "service-disabled"]
    (service,) = status.services
    assert not service.active and not service.healthy and service.served_model is None
    assert "refused" in service.error
    assert exit_code([status]) == EXIT_UNHEALTHY


def test_a_missing_unit_is_named_once(tmp_path):
    status = status_of(tmp_path, changed(**{"units.llama-tiny-llama": {"load": "not-found", "active": "inactive"}}))
    assert whats(status) == ["service-missing"]


@pytest.mark.parametrize(("edit", "what"), [
    ({"inode": 99}, "model-replaced"),
    ({"mtime_ns": 1}, "model-replaced"),
    ({"exists": False}, "model-missing"),
    ({"marker": None}, "model-unverified"),
])
def test_a_model_file_that_is_not_the_one_checked_at_install_is_drift(tmp_path, edit, what):
    state = {**ANSWERS["files"][MODEL], **edit}
    state["matches"] = bool(state["marker"]) and all(state["marker"][key] == state[key]
                                                     for key in ("size", "mtime_ns", "inode", "uid"))
    status = status_of(tmp_path, changed(**{"files": {MODEL: state}}))
    assert whats(status) == [what]
    assert status.models[0]["ok"] is False


def test_a_model_recorded_with_another_checksum_differs_from_the_plan(tmp_path):
    marker = {**ANSWERS["files"][MODEL]["marker"], "sha256": "f" * 64}
    status = status_of(tmp_path, changed(**{"files": {MODEL: {**ANSWERS["files"][MODEL], "marker": marker}}}))
    assert whats(status) == ["model-differs"] and "f" * 64 in status.drift[0].detail


def test_another_engine_switched_in_is_drift(tmp_path):
    status = status_of(tmp_path, changed(**{"links": {"/opt/llama/cpu/current": "deadbee"}}))
    assert whats(status) == ["engine-switched"]
    assert "points at deadbee, the plan says 0c1e570" in status.drift[0].detail
    assert whats(status_of(tmp_path, changed(links={"/opt/llama/cpu/current": None}))) == ["engine-missing"]


def test_the_lock_is_compared_when_it_names_the_box(tmp_path):
    same = BoxLock(engines={"cpu-0c1e570": LockedEngine(slot="cpu", commit="0c1e570", platform="linux-x86_64")},
                   models={"tiny-llama-128k-q8_0.gguf": LockedModel(id="tiny-llama", sha256=SHA)},
                   services={"llama-tiny-llama": LockedService(model="tiny-llama", engine="cpu-0c1e570",
                                                               host="127.0.0.1", port=18080, args=["--port", "18080"])})
    status = status_of(tmp_path, locked=same)
    assert status.drift == [] and status.locked and status.engines[0]["locked"] == "0c1e570"
    other = same.model_copy(deep=True)
    other.engines["cpu-0c1e570"].commit = "1111111"
    other.models["tiny-llama-128k-q8_0.gguf"].sha256 = "e" * 64
    other.services["llama-tiny-llama"].port = 18090
    assert whats(status_of(tmp_path, locked=other)) == ["plan-differs-from-lock", "model-differs-from-lock",
                                                        "engine-differs-from-lock"]
    assert all("--locked" in drift.fix for drift in status_of(tmp_path, locked=other).drift)


def test_a_driver_of_another_branch_than_planned_is_drift(tmp_path):
    from controller.model.serveplan import DriverPlan

    the_plan = plan()
    the_plan.driver = DriverPlan(manage=True, branch=580, installs=True)
    assert whats(status_of(tmp_path, the_plan=the_plan)) == ["driver-branch"]


def test_unreachable_and_unprovisioned_boxes_are_reported_not_raised(tmp_path):
    gone = box_status(box(tmp_path), plan(), None, fleet_path=FLEET, unreachable="ssh: connect refused")
    assert gone.reachable is False and gone.error == "ssh: connect refused" and gone.services == []
    never = box_status(box(tmp_path), None, None, fleet_path=FLEET)
    assert never.reachable is False and [d.what for d in never.drift] == ["not-provisioned"]
    healthy = status_of(tmp_path)
    assert exit_code([healthy, gone]) == EXIT_UNREACHABLE
    assert to_json([healthy, gone])["boxes"][1]["reachable"] is False
    assert human(gone).startswith("lab1: unreachable: ssh: connect refused")


def test_the_exit_code_is_the_first_that_applies(tmp_path):
    drifted = status_of(tmp_path, changed(links={"/opt/llama/cpu/current": "deadbee"}))
    sick = status_of(tmp_path, changed(**{"servers.llama-tiny-llama.health": "loading model"}))
    assert exit_code([status_of(tmp_path)]) == EXIT_OK
    assert exit_code([drifted]) == EXIT_DRIFT
    assert exit_code([drifted, sick]) == EXIT_UNHEALTHY
    assert (EXIT_OK, EXIT_UNREACHABLE, EXIT_UNHEALTHY, EXIT_DRIFT) == (0, 3, 6, 9)
