"""A controller killed with SIGKILL takes its run with it (issue 19, item 4).

Real ansible-playbook runs against this machine (connection local) through controller.stages.runner, in a controller
process that the test kills: nothing of the run goes on, its secrets do not stay behind, and a second
controller on the same inventory does not start while any process of the first run is alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_runner import REPO, ansible_playbook_pids, local_inventory, playbook

pytestmark = pytest.mark.slow  # each test runs ansible-playbook twice (seconds)

RUN_SCRIPT = """\
import sys
from pathlib import Path
from controller.stages.runner import run_playbook
run_playbook(sys.argv[1], inventory=Path(sys.argv[2]), secrets={"llama_service_api_key": "sk-killed-run-0451"})
"""


def _stat_fields(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


Process = tuple[int, str]  # pid and start time: a pid alone may be another process by the time it is checked


def _alive(process: Process) -> bool:
    fields = _stat_fields(process[0])
    return bool(fields) and fields[0] != "Z" and fields[19] == process[1]  # a zombie runs nothing, holds no file


def _descendants(pid: int) -> set[Process]:
    """Every live process below ``pid`` (ansible-playbook's workers each lead a session of their own)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields and fields[0] != "Z":
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add((child, _stat_fields(child)[19] if _stat_fields(child) else ""))
            todo.append(child)
    return found


def _run_leader(controller: int) -> int:
    """The controller's child that leads its own process group: what ansible-runner spawned for the run."""
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields and int(fields[1]) == controller and int(fields[2]) == int(entry.name):
            return int(entry.name)
    raise AssertionError(f"controller {controller} has no run")


def _sleepers(duration: str) -> set[int]:
    found = subprocess.run(["pgrep", "-fx", f"sleep {duration}"], check=False, capture_output=True, text=True)
    return {int(pid) for pid in found.stdout.split()}


def _start(play: Path, inventory: Path, runs: Path) -> subprocess.Popen[str]:
    # TMPDIR: the runs' private folders land where this test can see them (TMPDIR is passed to runs).
    return subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, str(play), str(inventory)], cwd=REPO,
                            env={**os.environ, "TMPDIR": str(runs)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, process: subprocess.Popen[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@contextlib.contextmanager
def _reaped(processes: set[Process]):
    """Whatever the test leaves of a run (on a controller without the fix, all of it) is killed at the end."""
    try:
        yield
    finally:
        for process in processes:
            if _alive(process):
                with contextlib.suppress(OSError):
                    os.kill(process[0], signal.SIGKILL)


SLEEP = "117.25"  # odd durations, to find this test's sleeps among the machine's processes
SHORT_SLEEP = "8.25"


def test_a_killed_controller_leaves_no_playbook_and_no_secrets(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inventory")
    runs = tmp_path / "runs"
    runs.mkdir()
    marker = tmp_path / "sleeping"
    play = playbook(tmp_path, f"""\
        - name: Say the run started
          ansible.builtin.command: touch {marker}
          changed_when: false
        - name: Wait for a long time
          ansible.builtin.command: sleep {SLEEP}
          changed_when: false
        """)
    controller = _start(play, inventory, runs)
    _wait_for(marker, controller)
    deadline = time.monotonic() + 30
    while not _sleepers(SLEEP):
        assert time.monotonic() < deadline and controller.poll() is None
        time.sleep(0.1)
    run = _descendants(controller.pid)
    with _reaped(run):
        assert ansible_playbook_pids(play)
        assert list(runs.glob("v100box-run-*/secrets.yml"))  # the run's secrets are on disk while it runs
        controller.kill()
        controller.communicate(timeout=10)
        deadline = time.monotonic() + 3
        while any(_alive(process) for process in run) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ansible_playbook_pids(play) == set()
        assert [process for process in run if _alive(process)] == []  # not a worker, not the sleep
        assert _sleepers(SLEEP) == set()
        assert list(runs.glob("v100box-run-*")) == []  # the secrets went with the run, before any next start


SECOND = """\
- name: Second play
  hosts: all
  gather_facts: false
  tasks:
    - name: Say the second run started
      ansible.builtin.shell: echo second >> {log}
      changed_when: false
"""


def test_the_inventory_stays_locked_while_a_run_of_a_killed_controller_goes_on(tmp_path: Path) -> None:
    """Killed with its run's leader (a kill -9 of both, the OOM killer): the task in flight finishes in a worker
    of ansible-playbook, and a second controller waits for it; then the dead run's folder is removed."""
    inventory = local_inventory(tmp_path / "inventory")
    runs = tmp_path / "runs"
    runs.mkdir()
    log = tmp_path / "log"
    play = playbook(tmp_path, f"""\
        - name: Start, wait and end
          ansible.builtin.shell: echo start >> {log}; sleep {SHORT_SLEEP}; echo end >> {log}
          changed_when: false
        """)
    second_play = tmp_path / "second.yml"
    second_play.write_text(SECOND.format(log=log))
    first = _start(play, inventory, runs)
    _wait_for(log, first)
    time.sleep(0.5)
    leader = _run_leader(first.pid)
    with _reaped(_descendants(first.pid)):
        os.kill(leader, signal.SIGKILL)
        first.kill()
        first.communicate(timeout=10)
        assert _sleepers(SHORT_SLEEP)  # a worker of the killed run still runs the shell task
        second = _start(second_play, inventory, runs)
        _out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        assert log.read_text().split() == ["start", "end", "second"]  # the second run began after the first ended
        assert "is still stopping" in err
        assert list(runs.glob("v100box-run-*")) == []  # the killed run's secrets went at the next start
