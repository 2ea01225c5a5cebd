"""roles/llama_service on Windows: which services a run moves to another engine version (read from their WinSW
configuration, the Windows engine switch), and the sentence the run fails with after switching them back. The
role's own tasks, run by Ansible on localhost with the answers of the Windows modules given (no Windows host)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.unit.windows.ansible_local import ROLES, WINDOWS_FACTS, role_vars, run_playbook

pytestmark = pytest.mark.slow

TASKS = ROLES / "llama_service" / "tasks"
ROOT = r"C:\llama\engines"
INSTANCES = [
    {"name": "llama-gemma", "model": "gemma", "engine": "upstream", "version": "0badbad", "port": 8011, "args": []},
    {"name": "llama-qwen", "model": "qwen", "engine": "ik", "version": "b2", "port": 8012, "args": []},
    {"name": "llama-new", "model": "new", "engine": "upstream", "version": "0badbad", "port": 8013, "args": []},
]
# What "Read the engine version each service ran before" returns: llama-new has no configuration yet.
BEFORE = {"llama-gemma": rf"{ROOT}\upstream\02182fc\bin\llama-server.exe",
          "llama-qwen": rf"{ROOT}\ik\b2\bin\llama-server.exe"}


def _task(file: str, name: str) -> dict:
    (task,) = [task for task in yaml.safe_load((TASKS / file).read_text()) if task["name"] == name]
    return task


def _shown(stdout: str) -> object:
    return json.loads(stdout[stdout.index("{"):])["plays"][0]["tasks"][-1]["hosts"]["localhost"]["msg"]


def _run(tmp_path, tasks: list[dict], extra: dict) -> tuple[object, str]:
    plays = [{"name": "Render", "hosts": "localhost", "gather_facts": False, "vars_files": role_vars("llama_service"),
              "tasks": tasks}]
    extra = {**WINDOWS_FACTS, "llama_service_engine_root": ROOT, "llama_service_instances": INSTANCES, **extra}
    done = run_playbook(tmp_path, plays, extra, json_output=True)
    return done, done.stdout


def test_the_services_moved_to_another_version_are_read_from_their_configuration(tmp_path):
    tasks = [_task("windows-configure.yml", "Note the services this run moves to another engine version"),
             {"name": "Show", "ansible.builtin.debug": {"msg": "{{ __llama_service_win_switched }}"}}]
    done, stdout = _run(tmp_path, tasks, {"__llama_service_win_before": {"result": BEFORE}})
    assert done.returncode == 0, stdout + done.stderr
    assert _shown(stdout) == [{"name": "llama-gemma", "slot": "upstream", "from": "02182fc", "to": "0badbad"}]


@pytest.mark.parametrize(("found", "again", "says"), [
    (True, False, "rolled back to upstream 02182fc, which is serving again."),
    (True, True, "rolled back to upstream 02182fc, which did not become healthy either."),
    (False, False, "not rolled back: upstream 02182fc is no longer installed."),
], ids=["serving-again", "still-failing", "old-version-gone"])
def test_the_run_fails_saying_what_the_rollback_did(tmp_path, found, again, says):
    switched = [{"name": "llama-gemma", "slot": "upstream", "from": "02182fc", "to": "0badbad"}]
    logs = {"results": [
        {"item": {"item": {"item": INSTANCES[0]}}, "result": ["CUDA error: no kernel image for this device"]},
        {"item": {"item": {"item": INSTANCES[2]}}, "result": ["error: port 8013 in use"]},
    ]}
    names = ["Note the servers that failed on a new engine version", "List the services to put back on the versions "
             "they ran before", "Fail, saying which upgrade was rolled back and whether the servers serve again"]
    tasks = [_task("windows-rollback.yml", name) for name in names]
    tasks[-1] = {**tasks[-1], "ignore_errors": True, "register": "__message"}
    tasks.append({"name": "Show", "ansible.builtin.debug": {"msg": "{{ __message.msg }}"}})
    extra = {
        "__llama_service_win_switched": switched,
        "__llama_service_win_logs": logs,
        "__llama_service_win_undo_found": {"results": [{"item": switched[0], "stat": {"exists": found}}]},
        "__llama_service_win_health_again": {"results": [{"item": INSTANCES[0], "failed": again}] if found else []},
    }
    done, stdout = _run(tmp_path, tasks, extra)
    assert done.returncode == 0, stdout + done.stderr
    message = _shown(stdout)
    assert message.startswith(f"llama-gemma did not become healthy on engine upstream 0badbad; {says}"), message
    assert "CUDA error: no kernel image for this device" in message
    assert r"(C:\llama\services\llama-gemma\logs)" in message
    assert "llama-new did not answer /health within 600 s. Its log ends with: error: port 8013 in use." in message
