"""roles/llama_engine's switch and rollback on real links in a temporary folder (Ansible on localhost): the switch
records what it replaced, the rollback points current and previous back as they were, and a first install or a
slot not named is left alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.windows.ansible_local import run_playbook


def _slot(root: Path, name: str, versions: list[str], current: str = "", previous: str = "") -> Path:
    slot = root / name
    for version in versions:
        server = slot / version / "bin" / "llama-server"
        server.parent.mkdir(parents=True)
        server.write_text("#!/bin/sh\n")
    for link, target in (("current", current), ("previous", previous)):
        if target:
            (slot / link).symlink_to(target)
    return slot


def _links(slot: Path) -> dict[str, str]:
    return {link: os.readlink(slot / link) for link in ("current", "previous") if (slot / link).is_symlink()}


def _switch(slot: str, version: str) -> list[dict]:
    return [
        {"name": f"Read {slot}", "ansible.builtin.include_role": {"name": "v100box.llm.llama_engine", "tasks_from": "slot.yml"},
         "vars": {"__llama_engine_slot_name": slot}},
        {"name": f"Switch {slot} to {version}",
         "ansible.builtin.include_role": {"name": "v100box.llm.llama_engine", "tasks_from": "switch.yml"},
         "vars": {"__llama_engine_switch_slot": slot, "__llama_engine_switch_version": version}},
    ]


def _play(root: Path, tasks: list[dict]) -> list[dict]:
    return [{"name": "Switch and roll back", "hosts": "localhost", "gather_facts": False,
             "vars": {"llama_engine_root": str(root)}, "tasks": tasks}]


def _rollback(slots: list[str]) -> dict:
    return {"name": "Roll back", "ansible.builtin.include_role": {"name": "v100box.llm.llama_engine", "tasks_from": "rollback.yml"},
            "vars": {"llama_engine_rollback_slots": slots}}


def _check(expression: str) -> dict:
    return {"name": f"Check {expression}", "ansible.builtin.assert": {"that": expression}}


def test_rollback_restores_both_links_and_keeps_the_new_version(tmp_path):
    root = tmp_path / "engines"
    upgraded = _slot(root, "cpu", ["v1", "v2", "v3"], current="v2", previous="v1")
    untouched = _slot(root, "ik", ["a", "b"], current="a")
    tasks = [*_switch("cpu", "v3"), *_switch("ik", "b"),
             _check("llama_engine_switched | map(attribute='slot') | list == ['cpu', 'ik']"),
             _rollback(["cpu"]),
             _check("llama_engine_rolled_back == [{'slot': 'cpu', 'from': 'v2', 'to': 'v3', 'previous': 'v1'}]"),
             _check("llama_engine_switched | map(attribute='slot') | list == ['ik']")]
    # keep 3: the switch itself removes nothing here
    done = run_playbook(tmp_path, _play(root, tasks), extra_vars={"llama_engine_keep_versions": 3}, windows=False)
    assert done.returncode == 0, done.stdout[-3000:]
    assert _links(upgraded) == {"current": "v2", "previous": "v1"}
    assert (upgraded / "v3" / "bin" / "llama-server").exists()  # the failed version stays beside the old one
    assert _links(untouched) == {"current": "b", "previous": "a"}


def test_previous_is_removed_when_its_version_went_with_the_switch(tmp_path):
    root = tmp_path / "engines"
    slot = _slot(root, "cpu", ["v1", "v2", "v3"], current="v2", previous="v1")
    for age, version in enumerate(["v1", "v2", "v3"]):  # oldest first, as installed
        os.utime(slot / version, (1_000_000 + age, 1_000_000 + age))
    tasks = [*_switch("cpu", "v3"), _rollback(["cpu"])]
    done = run_playbook(tmp_path, _play(root, tasks), windows=False)  # keep 2: the switch removes v1
    assert done.returncode == 0, done.stdout[-3000:]
    assert not (slot / "v1").exists()
    assert _links(slot) == {"current": "v2"}


@pytest.mark.parametrize("before", [{}, {"current": "v1"}], ids=["first-install", "same-version"])
def test_nothing_to_roll_back_without_a_replaced_version(tmp_path, before):
    root = tmp_path / "engines"
    slot = _slot(root, "cpu", ["v1"], **before)
    tasks = [*_switch("cpu", "v1"), _check("llama_engine_switched | default([]) == []"), _rollback(["cpu"]),
             _check("llama_engine_rolled_back == []")]
    done = run_playbook(tmp_path, _play(root, tasks), windows=False)
    assert done.returncode == 0, done.stdout[-3000:]
    assert _links(slot) == {"current": "v1"}


def test_boxes_of_one_run_with_different_packs_go_through_each_pack_together(tmp_path):
    # Two boxes of one run, each with its own pack (another version): the pack's tasks run once for both boxes, not
    # in a copy per box that the linear strategy would run one box after the other.
    hosts = {}
    for box, version in (("box-a", "v1"), ("box-b", "v2")):
        root = tmp_path / box
        _slot(root, "cpu", [version], current=version)
        hosts[box] = {"llama_engine_root": str(root),
                      "llama_engine_packs": [{"name": "cpu", "version": version,
                                              "url": f"http://127.0.0.1:9/llama-cpu-{version}.tar.gz"}]}
    plays = [{"name": "Install the packs", "hosts": "all", "gather_facts": False,
              "pre_tasks": [{"name": "Neither Debian nor Red Hat: no runtime packages",
                             "ansible.builtin.set_fact": {"ansible_os_family": "Other", "cacheable": True}}],
              "tasks": [{"name": "Install", "ansible.builtin.include_role": {"name": "v100box.llm.llama_engine",
                                                                              "tasks_from": "linux.yml"}}]}]
    done = run_playbook(tmp_path, plays, json_output=True, windows=False, hosts=hosts)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tasks = json.loads(done.stdout[done.stdout.index("{"):])["plays"][0]["tasks"]
    reads = [task for task in tasks if "Read the installed versions and links" in task["task"]["name"]]
    assert [sorted(task["hosts"]) for task in reads] == [["box-a", "box-b"]], [task["task"]["name"] for task in reads]
    assert all(reads[0]["hosts"][box]["rc"] == 0 for box in hosts)
    assert {box: _links(tmp_path / box / "cpu") for box in hosts} == {"box-a": {"current": "v1"}, "box-b": {"current": "v2"}}
