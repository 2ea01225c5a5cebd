"""The fleet lock: what it records, how it compares, and each refusal (controller/actions/lock.py, `controller lock`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from controller.actions.lock import (
    TEMPLATE_FILES,
    box_entry,
    check_box,
    check_fleet,
    differences,
    dumps,
    entry_for,
    lock_path,
    parse_sums,
    read_lock,
    updated,
)
from controller.errors import LockError
from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import Cpu, Driver, HardwareProfile, OsInfo
from controller.stages.planner import plan_box
from lab.fileserver import FileServer
from tests.cli import invoke

SHA = "cd" * 32
OTHER_SHA = "ef" * 32
PACK_SHA = "ab" * 32
PACK = "llama-cpu-0c1e570-linux-x86_64.tar.gz"
CPU_PROFILE = HardwareProfile(cpu=Cpu(model="EPYC", cores=2, threads=4), memory_mib=8192, os=OsInfo(family="linux"),
                              driver=Driver(version="580.82.07"))


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """A real engine mirror on loopback whose SHA256SUMS lists the CPU pack (the catalog pins no sha256 for it)."""
    root = tmp_path_factory.mktemp("mirror")
    (root / "engines").mkdir()
    (root / "engines" / "SHA256SUMS").write_text(f"{PACK_SHA}  {PACK}\n")
    with FileServer(root) as server:
        yield server.url


def write_catalog(folder: Path, sha256: str = SHA, size: int = 1000) -> Path:
    path = folder / "catalog.yml"
    path.write_text(yaml.safe_dump({"models": {
        "tiny": {"name": "t", "repo": "lab/r", "file": "t.gguf", "size_bytes": size, "sha256": sha256,
                 "engine": "upstream", "template": "gemma4-nothink.jinja"}}}))
    return path


def make_fleet(folder: Path, boxes: tuple[str, ...] = ("box1",), mirror: str | None = None, **box):
    data = {"catalogs": ["catalog.yml"],
            "boxes": {name: {"address": "127.0.0.1", "port": 2200 + i, "models": [{"id": "tiny", "ctx": 2048}],
                             "base_port": 18080,
                             **({"mirror": {"engines": f"{mirror}/engines", "models": mirror}} if mirror else {}),
                             **box} for i, name in enumerate(boxes)}}
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump(data))
    return parse_fleet(data, path), path


def planned(folder: Path, profile: HardwareProfile = CPU_PROFILE, sha256: str = SHA, **box):
    write_catalog(folder, sha256)
    fleet, path = make_fleet(folder, **box)
    catalog = load_catalog(fleet.catalogs)
    box1 = fleet.box("box1")
    plan = plan_box(box1, profile, catalog)
    return fleet, path, box1, plan


def test_the_entry_records_driver_engine_models_templates_and_the_plan(tmp_path, mirror):
    fleet, path, box, plan = planned(tmp_path, mirror=mirror)
    entry = entry_for(box, CPU_PROFILE, plan)
    assert entry.driver.branch == 580 and entry.driver.installed == "580.82.07"
    (engine_id, engine), = entry.engines.items()
    assert engine_id == "cpu-0c1e570" and engine.commit == "0c1e570" and engine.slot == "cpu"
    assert engine.file == PACK and engine.sha256 == PACK_SHA  # from the mirror's SHA256SUMS, as the box checks it
    assert entry.models["t.gguf"].sha256 == SHA and entry.models["t.gguf"].size_bytes == 1000
    template = (TEMPLATE_FILES / "gemma4-nothink.jinja").read_bytes()
    assert entry.templates["gemma4-nothink.jinja"].sha256 == hashlib.sha256(template).hexdigest()
    (name, service), = entry.services.items()
    assert service.port == 18080 and service.args == plan.services[0].args and service.env == plan.services[0].env
    assert name == plan.services[0].name and service.template == "gemma4-nothink.jinja"


def test_the_file_is_stable_sorted_and_reads_back(tmp_path):
    fleet, path, box, plan = planned(tmp_path, boxes=("box2", "box1"))
    entries = {name: entry_for(fleet.box(name), CPU_PROFILE, plan) for name in ("box2", "box1")}
    lock = updated(None, fleet, path, entries)
    text = dumps(lock)
    assert text == dumps(updated(None, fleet, path, dict(reversed(entries.items()))))  # order does not matter
    assert text.index("box1:") < text.index("box2:") and "fleet.yml" in text
    assert set(yaml.safe_load(text)) == {"version", "fleet", "boxes"}  # nothing that changes on every run
    target = lock_path(path)
    assert target == tmp_path / "fleet.lock.yml"
    target.write_text(text)
    assert read_lock(target) == lock and read_lock(tmp_path / "none.lock.yml") is None


def test_a_changed_checksum_in_the_catalog_is_refused_by_name(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    lock = updated(None, fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)})
    _f, _p, _b, changed = planned(tmp_path, sha256=OTHER_SHA)
    with pytest.raises(LockError) as refused:
        check_box(lock, "box1", entry_for(box, CPU_PROFILE, changed), path, lock_path(path))
    message = str(refused.value)
    assert refused.value.exit_code == 7 and "\n" not in message
    assert "model file t.gguf: sha256 is now efefefefefef…, the lock says cdcdcdcdcdcd…" in message
    assert "controller lock --fleet" in message and "--update" in message


def test_a_newer_engine_is_refused_by_name(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    lock = updated(None, fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)})
    newer = plan.model_copy(deep=True)
    newer.engines[0].id, newer.engines[0].commit = "cpu-1a2b3c4", "1a2b3c4"
    with pytest.raises(LockError, match=r"engine cpu: the catalog now gives cpu-1a2b3c4 \(commit 1a2b3c4\), "
                                        r"the lock says cpu-0c1e570 \(commit 0c1e570\)"):
        check_box(lock, "box1", entry_for(box, CPU_PROFILE, newer), path, lock_path(path))


def test_a_different_probe_result_that_changes_the_arguments_is_refused(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    lock = updated(None, fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)})
    bigger = CPU_PROFILE.model_copy(update={"cpu": Cpu(model="EPYC", cores=8, threads=16)})
    _f, _p, _b, replanned = planned(tmp_path, profile=bigger)
    with pytest.raises(LockError) as refused:
        check_box(lock, "box1", entry_for(box, bigger, replanned), path, lock_path(path))
    assert "arguments differ: --threads: the lock has '2', now '8'" in str(refused.value)


def test_the_same_plan_passes_and_the_installed_driver_is_not_compared(tmp_path, mirror):
    fleet, path, box, plan = planned(tmp_path, mirror=mirror)
    lock = updated(None, fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)})
    fresh = CPU_PROFILE.model_copy(update={"driver": Driver()})  # a second box, no driver yet: the role installs it
    check_box(lock, "box1", entry_for(box, fresh, plan), path, lock_path(path))


def test_a_changed_box_definition_is_named(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    locked = entry_for(box, CPU_PROFILE, plan)
    changed_fleet, _path = make_fleet(tmp_path, vars={"llama_service_extra": 1})
    lines = differences(locked, entry_for(changed_fleet.box("box1"), CPU_PROFILE, plan))
    assert lines == ['the fleet\'s vars for the box is now {"llama_service_extra": 1}, the lock says {}']


def test_a_lock_written_before_models_could_be_pinned_still_matches_and_a_pin_is_named(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    locked = entry_for(box, CPU_PROFILE, plan)
    assert set(locked.definition["models"][0]) == {"id", "ctx", "agents", "clients", "draft", "engine", "mix_cards"}
    assert differences(locked, entry_for(box, CPU_PROFILE, plan)) == []
    pinned_fleet, _path = make_fleet(tmp_path)
    pinned = pinned_fleet.box("box1").model_copy(deep=True)
    pinned.models[0].board = 0
    lines = differences(locked, entry_for(pinned, CPU_PROFILE, plan))
    assert len(lines) == 1 and lines[0].startswith("the fleet's models for the box is now") and '"board": 0' in lines[0]


def test_a_file_without_a_checksum_cannot_be_installed_exactly(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    entry = entry_for(box, CPU_PROFILE, plan)  # the built-in CPU engine pins no sha256 and no SHA256SUMS was read
    lock = updated(None, fleet, path, {"box1": entry})
    with pytest.raises(LockError, match="pins no sha256 for engine cpu-0c1e570 pack"):
        check_box(lock, "box1", entry, path, lock_path(path))


def test_a_lock_from_another_fleet_file_is_refused(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    lock = updated(None, fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)})
    other = tmp_path / "other.yml"
    with pytest.raises(LockError, match="was written for fleet file fleet.yml .*not other.yml"):
        check_fleet(lock, fleet, other, lock_path(other))
    stranger, _ = make_fleet(tmp_path / "..", boxes=("gpu7",))  # same file name, none of its boxes
    with pytest.raises(LockError, match=r"written for fleet file fleet.yml \(box1\), not fleet.yml"):
        check_fleet(lock, stranger, path, lock_path(path))


def test_a_box_the_fleet_no_longer_names_is_refused_and_update_drops_it(tmp_path):
    fleet, path, box, plan = planned(tmp_path, boxes=("box1", "old"))
    entry = entry_for(box, CPU_PROFILE, plan)
    lock = updated(None, fleet, path, {"box1": entry, "old": entry})
    smaller, _ = make_fleet(tmp_path, boxes=("box1",))
    with pytest.raises(LockError, match="names box old, which fleet.yml no longer has: run `controller lock "
                                        ".* --update` to drop it"):
        check_fleet(lock, smaller, path, lock_path(path))
    assert set(updated(lock, smaller, path, {}).boxes) == {"box1"}


def test_sha256sums_lines_are_read_as_the_box_reads_them():
    text = f"{SHA}  a.tar.gz\n{OTHER_SHA} *b.tar.gz\n"
    assert parse_sums(text, "a.tar.gz") == SHA and parse_sums(text, "b.tar.gz") == OTHER_SHA
    assert parse_sums(text, "c.tar.gz") is None


def test_box_entry_keeps_only_templates_a_service_uses(tmp_path):
    fleet, path, box, plan = planned(tmp_path)
    entry = box_entry(box, None, plan, {"gemma4-nothink.jinja": SHA, "unused.jinja": OTHER_SHA})
    assert set(entry.templates) == {"gemma4-nothink.jinja"} and entry.driver.installed is None


# The command, on a box this machine probes itself (transport: local): probing and planning only.

def local_fleet(folder: Path, boxes: tuple[str, ...] = ("here",), sha256: str = SHA) -> Path:
    write_catalog(folder, sha256)
    path = folder / "fleet.yml"
    path.write_text(yaml.safe_dump({"catalogs": ["catalog.yml"], "boxes": {
        name: {"address": "127.0.0.1", "port": 2200 + i, "transport": "local", "models": [{"id": "tiny", "ctx": 2048}],
               "base_port": 18080} for i, name in enumerate(boxes)}}))
    return path


def test_lock_writes_then_compares_then_updates_with_what_changed(tmp_path):
    fleet = local_fleet(tmp_path)
    first = invoke("lock", "--fleet", str(fleet))
    assert first.exit_code == 0, first.output
    written = (tmp_path / "fleet.lock.yml").read_text()
    assert "here: added" in first.stdout and "t.gguf" in written

    again = invoke("lock", "--fleet", str(fleet))
    assert again.exit_code == 0 and "up to date" in again.stdout
    assert (tmp_path / "fleet.lock.yml").read_text() == written  # nothing rewritten

    write_catalog(tmp_path, OTHER_SHA)
    differs = invoke("lock", "--fleet", str(fleet))
    assert differs.exit_code == 7 and "Traceback" not in differs.output
    assert len(differs.stderr.strip().splitlines()) == 1 and "model file t.gguf: sha256 is now" in differs.stderr
    assert (tmp_path / "fleet.lock.yml").read_text() == written

    update = invoke("lock", "--fleet", str(fleet), "--update")
    assert update.exit_code == 0, update.output
    assert "here: model file t.gguf: sha256 is now efefefefefef…, the lock says cdcdcdcdcdcd…" in update.stdout
    assert OTHER_SHA in (tmp_path / "fleet.lock.yml").read_text()


def test_provision_locked_refuses_before_any_run(tmp_path):
    fleet = local_fleet(tmp_path)
    assert invoke("lock", "--fleet", str(fleet)).exit_code == 0
    write_catalog(tmp_path, OTHER_SHA)
    refused = invoke("provision", "here", "--fleet", str(fleet), "--locked")
    assert refused.exit_code == 7, refused.output
    assert len(refused.stderr.strip().splitlines()) == 1 and "box here: model file t.gguf" in refused.stderr
    assert not (tmp_path / "inventory" / "host_vars").exists() and not (tmp_path / "inventory" / "artifacts").exists()


def test_provision_locked_without_a_lock_says_how_to_write_one(tmp_path):
    fleet = local_fleet(tmp_path)
    refused = invoke("provision", "here", "--fleet", str(fleet), "--locked")
    assert refused.exit_code == 7 and "has no lock" in refused.stderr and "controller lock --fleet" in refused.stderr


def test_the_command_refuses_another_fleets_lock_and_a_box_the_fleet_dropped(tmp_path):
    fleet = local_fleet(tmp_path, boxes=("here", "there"))
    assert invoke("lock", "--fleet", str(fleet)).exit_code == 0
    lock_file = tmp_path / "fleet.lock.yml"

    other = local_fleet(tmp_path / "..", boxes=("here", "there")).rename(tmp_path / "other.yml")
    (tmp_path / "other.lock.yml").write_text(lock_file.read_text())  # a lock copied from another fleet
    foreign = invoke("lock", "--fleet", str(other), "--update")
    assert foreign.exit_code == 7 and "was written for fleet file fleet.yml" in foreign.stderr
    foreign_run = invoke("provision", "here", "--fleet", str(other))  # unlocked provisioning writes into it
    assert foreign_run.exit_code == 7 and "was written for fleet file fleet.yml" in foreign_run.stderr

    local_fleet(tmp_path, boxes=("here",))
    dropped = invoke("provision", "here", "--fleet", str(fleet), "--locked")
    assert dropped.exit_code == 7 and "names box there, which fleet.yml no longer has" in dropped.stderr
    update = invoke("lock", "--fleet", str(fleet), "--update")
    assert update.exit_code == 0 and "there: removed (the fleet no longer names it)" in update.stdout
    assert "there:" not in lock_file.read_text()


def test_a_damaged_lock_is_refused_with_what_to_do(tmp_path):
    fleet = local_fleet(tmp_path)
    (tmp_path / "fleet.lock.yml").write_text("version: 9\n")
    refused = invoke("lock", "--fleet", str(fleet))
    assert refused.exit_code == 7 and "not a lock this controller writes" in refused.stderr


def test_recording_a_provisioned_box_says_what_changed(tmp_path, mirror):
    """What provisioning records for a box that ran (controller.actions.provision; tests/unit/test_provision.py)."""
    from controller.actions.lock import record

    fleet, path, box, plan = planned(tmp_path, mirror=mirror)
    assert record(lock_path(path), fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)}) == ["box1: added"]
    lock = read_lock(lock_path(path))
    assert set(lock.boxes) == {"box1"} and lock.boxes["box1"].driver.installed == "580.82.07"
    assert lock.boxes["box1"].engines["cpu-0c1e570"].sha256 == PACK_SHA
    assert record(lock_path(path), fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)}) == []

    plan.services[0].args[plan.services[0].args.index("--ctx-size") + 1] = "4096"
    assert record(lock_path(path), fleet, path, {"box1": entry_for(box, CPU_PROFILE, plan)}) == [
        f"box1: service {plan.services[0].name}: arguments differ: --ctx-size: the lock has '2048', now '4096'"]


def test_runs_side_by_side_lose_no_entries(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from controller.actions.lock import record

    names = tuple(f"box{i}" for i in range(1, 9))
    fleet, path, box, plan = planned(tmp_path, boxes=names)
    entries = {name: entry_for(fleet.box(name), CPU_PROFILE, plan) for name in names}
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda name: record(lock_path(path), fleet, path, {name: entries[name]}), names))
    assert set(read_lock(lock_path(path)).boxes) == set(names)
