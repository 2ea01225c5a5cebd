"""Many boxes at once: which boxes a command selects, the fleet checks across boxes, the one shared run's
per-box view, each box's secrets in its own host variables, and the summary a person and a script read."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from controller.actions.fleetrun import FAILED, OK, UNREACHABLE, BoxOutcome, FleetRun, failure_message, host_run
from controller.cli.progress import FleetProgress, summary_table
from controller.errors import FleetError
from controller.model.fleet import load_fleet, parse_fleet
from controller.stages.render import hosts_yml
from controller.stages.runner import FailedTask, HostStats, RunResult, run_playbook
from tests.cli import invoke, run_controller
from tests.unit.clean_errors import assert_one_line_error

FLEET = """
groups:
  rack1: [b2, a1]
  rack2: [c3]
boxes:
  a1: {address: 192.0.2.1}
  b2: {address: 192.0.2.2}
  c3: {address: 192.0.2.3}
"""


def fleet_file(tmp_path: Path, text: str = FLEET) -> Path:
    path = tmp_path / "fleet.yml"
    path.write_text(text)
    return path


def test_boxes_groups_and_all_select_in_the_order_given_without_repeats(tmp_path):
    fleet = load_fleet(fleet_file(tmp_path))
    assert fleet.select(["c3"]) == ["c3"]
    assert fleet.select(["rack1"]) == ["b2", "a1"]
    assert fleet.select(["c3", "rack1", "a1"]) == ["c3", "b2", "a1"]
    assert fleet.select([], everything=True) == ["a1", "b2", "c3"]
    with pytest.raises(FleetError, match=r"no box or group named 'rack9' \(boxes: a1, b2, c3; groups: rack1, rack2\)"):
        fleet.select(["a1", "rack9"])
    with pytest.raises(FleetError, match="not both"):
        fleet.select(["a1"], everything=True)
    with pytest.raises(FleetError, match="or give --all"):
        fleet.select([])


@pytest.mark.parametrize(("groups", "words"), [
    ("{rack1: [a1, zz]}", ["group 'rack1' names 'zz', not a box of this fleet"]),
    ("{a1: [a1]}", ["group 'a1' has the name of a box"]),
    ("{linux: [a1]}", ["group 'linux'", "which the inventory uses"]),
    ("{rack1: []}", ["group 'rack1' names no box"]),
])
def test_a_bad_group_is_one_line_and_exit_2(tmp_path, groups, words):
    path = fleet_file(tmp_path, f"groups: {groups}\nboxes:\n  a1: {{address: 192.0.2.1}}\n")
    line = assert_one_line_error(run_controller("provision", "--all", "--fleet", str(path), timeout=60), 2, *words)
    assert "field" not in line and "Value error" not in line


def test_two_boxes_at_one_address_and_port_are_refused_naming_both(tmp_path):
    path = fleet_file(tmp_path, """
boxes:
  a1: {address: 192.0.2.1}
  b2: {address: 192.0.2.1, port: 22}
  lab1: {address: 127.0.0.1, port: 2201}
  lab2: {address: localhost, port: 2202}
""")
    assert_one_line_error(run_controller("provision", "--all", "--fleet", str(path), timeout=60), 2,
                          str(path), "boxes 'a1' and 'b2' share the address 192.0.2.1:22")
    # The same address with its own port is another box (the lab's containers share 127.0.0.1).
    ok = parse_fleet({"boxes": {"lab1": {"address": "127.0.0.1", "port": 2201},
                                "lab2": {"address": "LOCALHOST", "port": 2202}}}, path)
    assert ok.shared_address() is None
    clash = {"boxes": {"lab1": {"address": "127.0.0.1", "port": 2201}, "lab2": {"address": "localhost", "port": 2201}}}
    with pytest.raises(FleetError, match="boxes 'lab1' and 'lab2' share the address localhost:2201"):
        parse_fleet(clash, path)


def test_hosts_yml_carries_the_fleets_groups(tmp_path):
    fleet = load_fleet(fleet_file(tmp_path))
    groups = hosts_yml(fleet, {})["all"]["children"]
    assert set(groups["rack1"]["hosts"]) == {"a1", "b2"} and set(groups["rack2"]["hosts"]) == {"c3"}
    assert set(groups["linux"]["hosts"]) == {"a1", "b2", "c3"}  # connection variables stay in the OS group
    assert groups["linux"]["hosts"]["a1"]["ansible_host"] == "192.0.2.1" and groups["rack1"]["hosts"]["a1"] == {}


def test_each_box_sees_the_shared_run_as_its_own():
    run = RunResult("site.yml", "failed", 2, 30.0,
                    stats={"a1": HostStats(ok=20, changed=5), "b2": HostStats(ok=3, failures=1),
                           "c3": HostStats(unreachable=1)},
                    failed=[FailedTask("b2", "Merge OpenClaw", "not JSON5"),
                            FailedTask("c3", "Gather", "ssh: connect refused", unreachable=True)])
    a1, b2, c3 = (host_run(run, host, 12.5) for host in ("a1", "b2", "c3"))
    assert (a1.status, a1.changed, a1.failed, a1.elapsed) == ("successful", 5, [], 12.5)
    assert (b2.status, [task.task for task in b2.failed]) == ("failed", ["Merge OpenClaw"])
    assert c3.status == "failed" and c3.failed[0].unreachable and set(c3.stats) == {"c3"}


def _fleet_run() -> FleetRun:
    return FleetRun([
        BoxOutcome("a1", OK, None, 7, 41.25, True, 0.8, 0.01, "/inv/reports/a1.json"),
        BoxOutcome("b2", FAILED, "task 'Merge OpenClaw' failed: /root/.openclaw/openclaw.json is not valid JSON5", 2,
                   30.0, False, 0.7, 0.01, "/inv/reports/b2.json"),
        BoxOutcome("ghost", UNREACHABLE, "box ghost (127.0.0.1:1): cannot connect", 0, 0.0, False),
    ], elapsed=44.0, prepare_seconds=1.5, forks=2)


def test_the_summary_table_has_a_row_per_box_with_result_changed_time_verified_and_why():
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(summary_table(_fleet_run()))
    text = console.export_text()
    header = next(line for line in text.splitlines() if line.startswith("box"))
    assert header.split() == ["box", "result", "changed", "time", "verified", "why"]
    rows = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in
            {"a1", "b2", "ghost"}}
    assert rows["a1"].split()[1:5] == ["ok", "7", "41.2s", "yes"]
    assert rows["b2"].split()[1:5] == ["failed", "2", "30.0s", "no"] and "is not valid JSON5" in rows["b2"]
    assert "unreachable" in rows["ghost"] and "cannot connect" in rows["ghost"]
    assert failure_message(_fleet_run()) == (
        "2 of 3 boxes did not provision: b2: failed: task 'Merge OpenClaw' failed: /root/.openclaw/openclaw.json is "
        "not valid JSON5; ghost: unreachable: box ghost (127.0.0.1:1): cannot connect")


def test_the_summary_says_which_ansible_strategy_the_run_went_under_and_why(tmp_path):
    from controller.stages.strategy import MITOGEN, Choice

    done = _fleet_run()
    done.strategy = Choice(MITOGEN, "a1 has no run that ended ok on record: every role is expected to run")
    stream = (tmp_path / "out").open("w+")
    FleetProgress(["a1", "b2", "ghost"], as_json=False, stream=stream).summary(done)
    stream.seek(0)
    assert ("Ansible strategy mitogen_linear: a1 has no run that ended ok on record: every role is expected to run"
            in stream.read())
    stream = (tmp_path / "out.json").open("w+")
    FleetProgress(["a1", "b2", "ghost"], as_json=True, stream=stream).summary(done)
    stream.seek(0)
    assert json.loads(stream.read())["strategy"] == {"name": "mitogen_linear", "reason": done.strategy.reason}


def test_the_json_summary_is_one_stable_object(tmp_path):
    stream = (tmp_path / "out").open("w+")
    FleetProgress(["a1", "b2", "ghost"], as_json=True, stream=stream).summary(_fleet_run())
    stream.seek(0)
    summary = json.loads(stream.read())
    assert summary["type"] == "fleet" and summary["failed"] == ["b2", "ghost"] and summary["forks"] == 2
    assert set(summary) == {"type", "boxes", "failed", "elapsed", "prepare_seconds", "run_seconds", "forks", "strategy"}
    assert summary["strategy"] is None  # no run: no strategy
    assert summary["run_seconds"] is None  # no site.yml run in this one
    assert [box["box"] for box in summary["boxes"]] == ["a1", "b2", "ghost"]
    assert set(summary["boxes"][0]) == {"box", "result", "reason", "changed", "seconds", "verified", "probe_seconds",
                                        "plan_seconds", "report", "unplaced", "provisioned_as_asked"}
    assert summary["boxes"][0]["seconds"] == 41.25 and summary["boxes"][2]["result"] == "unreachable"


def test_a_box_that_serves_only_what_fits_is_not_as_asked_and_fails_the_fleet_run(tmp_path):
    """Issue 21: the run serves the models that fit, but the box's result says it is not as asked (exit 8)."""
    import copy

    from controller.actions.fleetrun import NOT_AS_ASKED, Planned, finish
    from controller.model.serveplan import Unplaced
    from tests.unit.test_verify import RECORDED, plan_of, service
    from tests.unit.tiny_box import CPU_PROFILE

    box = parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", "api_key": {"env": "K"}}}},
                      tmp_path / "fleet.yml").box("box1")
    plan = plan_of(service())
    plan.fits, plan.unplaced = False, [Unplaced(model="qwen3.5-122b-a10b-q8_0", reason="needs 40960 MiB of RAM")]
    run = RunResult("site.yml", "successful", 0, 20.0, stats={"box1": HostStats(ok=9, changed=1)},
                    data={"llama_verify": {"box1": copy.deepcopy(RECORDED)}})
    outcome = BoxOutcome("box1")
    finish(Planned(box, CPU_PROFILE, plan, 0.5, 0.01), run, 0.0, tmp_path, outcome)
    assert outcome.verified is True and outcome.result == NOT_AS_ASKED == "not as asked"
    assert outcome.reason == "qwen3.5-122b-a10b-q8_0 was not placed: needs 40960 MiB of RAM"
    assert outcome.provisioned_as_asked is False
    assert outcome.unplaced == [{"model": "qwen3.5-122b-a10b-q8_0", "reason": "needs 40960 MiB of RAM"}]
    done = FleetRun([outcome], 21.0, 0.5)
    assert done.failed == [outcome]  # the fleet exits 8
    assert done.as_dict()["boxes"][0]["unplaced"] == outcome.unplaced
    assert "box1: not as asked: qwen3.5-122b-a10b-q8_0 was not placed" in failure_message(done)
    assert json.loads((tmp_path / "reports" / "box1.json").read_text())["provisioned_as_asked"] is False


def test_progress_lines_name_the_box_its_task_and_its_counts(tmp_path):
    stream = (tmp_path / "out").open("w+")
    progress = FleetProgress(["a1", "b2"], stream=stream)
    progress.stage("a1", "planned", "probed in 0.8s, planned tiny-llama:18080")
    progress({"event": "runner_on_ok", "event_data": {"host": "a1", "task": "Install engine", "res": {"changed": True}}})
    progress({"event": "runner_on_failed", "event_data": {"host": "b2", "task": "Merge OpenClaw", "res": {}}})
    stream.seek(0)
    lines = stream.read().splitlines()
    assert "a1" in lines[0] and "planned tiny-llama:18080" in lines[0]
    assert "a1" in lines[1] and "changed" in lines[1] and "Install engine" in lines[1]
    assert "ok=1 changed=1 failed=0" in lines[1]
    assert "b2" in lines[2] and "failed" in lines[2] and "ok=0 changed=0 failed=1" in lines[2]


def test_some_boxes_failing_prints_the_table_and_exits_8_naming_them(tmp_path, monkeypatch):
    monkeypatch.setattr("controller.actions.provision.provision", lambda fleet, names, inventory, **kw: _fleet_run())
    result = invoke("provision", "rack1", "c3", "--fleet", str(fleet_file(tmp_path)))
    assert result.exit_code == 8, result.output
    assert "fleet summary" in result.stdout and "1 of 3 boxes provisioned and verified" in result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: 2 of 3 boxes did not provision: b2: failed") and "ghost: unreachable" in line


def test_one_box_name_keeps_the_single_box_path(tmp_path, monkeypatch):
    """`controller provision BOX` is the one-box command as before (the box's own failure is the command's); a group
    name or several names are a fleet run, whose failures stay with their boxes."""
    chosen = []

    def provision(fleet, names, inventory, *, raise_failures=False, **kw):
        if raise_failures:
            raise SystemExit(42 if names == ["a1"] else 1)
        chosen.append(names)
        return FleetRun([], 0.0, 0.0)

    monkeypatch.setattr("controller.actions.provision.provision", provision)
    path = fleet_file(tmp_path)
    assert invoke("provision", "a1", "--fleet", str(path)).exit_code == 42
    for args, names in ((["rack2"], ["c3"]), (["a1", "c3"], ["a1", "c3"]), (["--all"], ["a1", "b2", "c3"])):
        assert invoke("provision", *args, "--fleet", str(path), "--json").exit_code == 0
        assert chosen.pop() == names
    monkeypatch.undo()
    unknown = invoke("provision", "nope", "--fleet", str(path))
    assert unknown.exit_code == 2 and "no box named 'nope'" in unknown.stderr


@pytest.mark.slow
def test_each_box_gets_only_its_own_secrets_verbatim_and_a_failing_box_does_not_stop_the_others(tmp_path):
    """host_secrets reach each host as its own variables (a template arrives as text), in one run with forks."""
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    (inventory / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {name: local for name in ("a1", "b2", "c3")}}}))
    play = tmp_path / "play.yml"
    play.write_text("- name: Each host writes its key\n  hosts: all\n  gather_facts: false\n  tasks:\n" + textwrap.indent(
        textwrap.dedent(f"""\
        - name: Fail on b2
          ansible.builtin.fail:
            msg: b2 breaks
          when: inventory_hostname == 'b2'
        - name: Write the key
          ansible.builtin.copy:
            content: "{{{{ llama_service_api_key | default('none') }}}}"
            dest: "{tmp_path}/{{{{ inventory_hostname }}}}.key"
            mode: "0600"
        """), "    "))
    keys = {"a1": "{{ 7 * 6 }}-key-of-a1-0123", "b2": "key-of-b2-0123456789", "c3": ""}
    result = run_playbook(str(play), inventory=inventory, limit="a1,b2,c3", forks=3, raise_on_failure=False,
                          host_secrets={name: {"llama_service_api_key": key} for name, key in keys.items()})
    assert result.status == "failed" and [task.host for task in result.failed] == ["b2"]
    assert (tmp_path / "a1.key").read_text() == keys["a1"]
    assert (tmp_path / "c3.key").read_text() == "none" and not (tmp_path / "b2.key").exists()
    assert result.stats["a1"].failures == 0 and result.stats["b2"].failures == 1
    command = (result.artifact_dir / "command").read_text()
    assert "--forks" in command and "key-of" not in command
    assert not any("key-of" in path.read_text(errors="ignore") for path in inventory.rglob("*") if path.is_file()
                   and "job_events" not in path.parts)
