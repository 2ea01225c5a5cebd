"""Run a role's tasks/preflight.yml on this machine (connection local) once per case, every case a host of one inventory
in one ansible-playbook run: a case costs no start of its own (tests/integration/test_role_preflights.py,
test_llama_service_preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.windows.ansible_local import run_playbook

LOOK_LIKE_WINDOWS = {"name": "Record that this host is a Windows box", "when": "pf_windows | default(false)",
                     "ansible.builtin.set_fact": {"ansible_os_family": "Windows", "cacheable": True}}


class Outcome(dict[str, "str | None"]):
    """Each case's failure message (None: it passed); ``output``: the run's whole report (the JSON callback's)."""

    output = ""


def run_preflights(tmp_path: Path, role: str, cases: dict[str, dict],
                   task_vars: dict[str, str] | None = None) -> Outcome:
    """Run the role's tasks/preflight.yml once per case; returns each case's failure message (None: it passed).

    ``task_vars``: variables of the include, which override the role's own vars/main.yml (a host's cannot).
    """
    include = {"name": "Run the preflight only",
               "ansible.builtin.include_role": {"name": f"v100box.llm.{role}", "tasks_from": "preflight.yml"}}
    play = [{"name": f"Run the {role} preflight", "hosts": "all", "gather_facts": False,
             "pre_tasks": [LOOK_LIKE_WINDOWS], "tasks": [{**include, "vars": task_vars} if task_vars else include]}]
    done = run_playbook(tmp_path, play, json_output=True, windows=False, hosts=cases, timeout=600)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise AssertionError(done.stdout[-3000:] + done.stderr[-3000:]) from None
    outcome = Outcome()
    outcome.output = done.stdout
    for name in cases:
        stats = report["stats"].get(name)
        assert stats is not None, f"{name} did not run: {done.stderr[-2000:]}"
        outcome[name] = None
        if stats["failures"] or stats["unreachable"]:
            failed = [result for play in report["plays"] for task in play["tasks"]
                      for host, result in task["hosts"].items() if host == name and result.get("failed")]
            assert failed, f"{name}: {stats}"
            item_messages = [item["msg"] for item in failed[-1].get("results", []) if item.get("failed")]
            outcome[name] = " | ".join(item_messages) or failed[-1]["msg"]
    return outcome


def expect(outcome: dict[str, str | None], case: str, *texts: str) -> None:
    message = outcome[case]
    assert message is not None, f"{case} passed the preflight"
    assert "\n" not in message.strip(), message
    for text in texts:
        assert text in message, f"{case}: {message}"
