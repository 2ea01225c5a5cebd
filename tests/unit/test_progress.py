"""The live progress lines print task and host names as written, whatever brackets they hold."""

from __future__ import annotations

import io
import json

from controller.cli.progress import FleetProgress, Progress


def test_task_names_with_square_brackets_print_as_written():
    out = io.StringIO()
    progress = Progress(stream=out)
    for task in ("Install packs [/] for [bold]every[/bold] engine", "Open port [8001] to [192.168.1.0/24]"):
        progress({"event": "runner_on_ok", "event_data": {"host": "box3", "task": task, "res": {"changed": True}}})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("changed     Install packs [/] for [bold]every[/bold] engine")
    assert lines[1].endswith("changed     Open port [8001] to [192.168.1.0/24]")


def _event(status: str, task: str, role: str = "", **res) -> dict:
    return {"event": f"runner_on_{status}", "event_data": {"host": "box3", "task": task, "role": role,
                                                           "task_action": "v100box.llm.box_manifest" if res else "",
                                                           "res": res}}


def test_a_run_prints_a_line_per_role_and_each_change_and_verbose_every_task():
    events = [_event("ok", "Gather facts"), _event("ok", "Find the V100s", "nvidia_driver"),
              _event("skipped", "Install the driver", "nvidia_driver"),
              _event("ok", "Write the unit", "llama_service", changed=True), _event("ok", "Start", "llama_service")]
    out = io.StringIO()
    progress = Progress(stream=out)
    for event in events:
        progress(event)
    progress.close()
    lines = [line.split(None, 1)[1] for line in out.getvalue().splitlines()]
    assert [" ".join(line.split()[:2]) for line in lines] == [
        "play ok=1", "nvidia_driver ok=1", "box3 changed", "llama_service ok=1"]
    assert "skipped=1" in lines[1] and "changed=1" in lines[3]
    verbose = io.StringIO()
    progress = Progress(stream=verbose, verbose=True)
    for event in events:
        progress(event)
    assert sum(" Write the unit" in line or " Install the driver" in line for line in verbose.getvalue().splitlines()) == 2


def test_the_fast_path_decision_is_said_in_words_and_in_json():
    decided = _event("ok", "Compare the box with the record of its last full run", converged=False,
                     reasons=["/etc/llama/a.env: mode changed"], entries=12)
    out = io.StringIO()
    Progress(stream=out)(decided)
    assert "box3: full run: /etc/llama/a.env: mode changed" in out.getvalue()
    out = io.StringIO()
    Progress(stream=out, as_json=True)(decided)
    assert json.loads(out.getvalue().splitlines()[1]) == {
        "type": "fast_path", "host": "box3", "converged": False, "reasons": ["/etc/llama/a.env: mode changed"],
        "entries": 12}
    out = io.StringIO()
    FleetProgress(["box3"], as_json=True, stream=out)(_event("ok", "Compare", converged=True, reasons=[], entries=9))
    assert json.loads(out.getvalue().splitlines()[0])["converged"] is True


def test_a_provisions_summary_names_its_ansible_strategy_and_why():
    from controller.stages.runner import HostStats, RunResult
    from controller.stages.strategy import LINEAR, Choice

    result = RunResult("site.yml", "successful", 0, 2.5, stats={"box1": HostStats(ok=9)})
    choice = Choice(LINEAR, "every box is expected to match the record of its last full run (one comparison each)")
    out = io.StringIO()
    Progress(stream=out).summary(result, choice)
    assert out.getvalue().splitlines()[-1] == f"Ansible strategy linear: {choice.reason}"
    out = io.StringIO()
    Progress(stream=out, as_json=True).summary(result, choice)
    assert json.loads(out.getvalue())["strategy"] == {"name": "linear", "reason": choice.reason}
