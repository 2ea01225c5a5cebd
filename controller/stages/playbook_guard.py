"""What ansible-runner starts for controller.stages.runner: ansible-playbook, which must not outlive its controller.

``python -I playbook_guard.py --parent PID --run-mutex FILE --run-dir DIR -- ARGS...`` runs
``ansible-playbook ARGS...`` and exits with its status. ansible-runner starts it on a pty in a session of its
own (pexpect, SIGHUP ignored), so when the controller is killed nothing would stop the playbook: it went on
re-parented to init, against a box a second controller was already provisioning. Here:

* the guard asks Linux for a signal when its parent dies (PR_SET_PDEATHSIG; the parent is the thread of the
  controller that spawned it, which waits in ansible-runner until the run ends) and watches the parent's pid
  besides; then it removes the run's private folder (the secrets) and kills every process of the run;
* it is a child subreaper (PR_SET_CHILD_SUBREAPER): ansible-playbook's workers start sessions of their own
  (setsid), so they are no process group's members, but whatever of the run loses its parent comes back to
  the guard, and the run is every process below it;
* ansible-playbook gets SIGKILL when the guard dies (killed with the controller, it cleans up nothing);
* when ansible-playbook has ended, its workers still running (after Ctrl-C, one may be in the middle of a task)
  get a few seconds, then SIGKILL: the run is over when the guard exits;
* ansible-playbook and its workers (forked) hold the inventory's run mutex shared, so a second controller
  on the inventory waits until the last of them ended (controller.inventory.Inventory.mutex).

Stdlib only and started with ``-I``: it runs beside ansible-playbook, not inside the controller.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PARENT_DEATH_SIGNAL = signal.SIGTERM
WATCH_INTERVAL_S = 0.5  # how often the parent's pid is checked, should the parent-death signal not come
KILL_DEADLINE_S = 10.0
# After ansible-playbook ended: how long its workers still running get before SIGKILL (an interrupted run's go on
# with their task otherwise). Below the controller's grace after Ctrl-C (runner.STOP_GRACE_S), which counts this
# process among the run's.
WORKER_GRACE_S = 3.0
ORPHANED_EXIT = 137


class _Orphaned(Exception):
    """The controller is gone."""


def _prctl(option: int, value: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the pid watch alone


def _die_with_guard() -> None:
    """In ansible-playbook, before exec: SIGKILL when the guard dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _children() -> dict[int, list[int]]:
    """Live (not zombie) processes by parent."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            tree.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _workers(argv: list[str]) -> list[int]:
    """The processes below the guard that are ansible-playbook's: its forked workers carry its command line."""
    tail = [part.encode() for part in argv]
    found = []
    for pid in _descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if cmdline[-len(tail):] == tail and any(part.endswith(b"ansible-playbook") for part in cmdline[:-len(tail)]):
            found.append(pid)
    return found


def end_workers(argv: list[str]) -> None:
    """ansible-playbook has ended; its workers, in sessions of their own, need not have: after Ctrl-C one may still
    run its task on the box. They get WORKER_GRACE_S, then SIGKILL, so that the run is over when the guard exits."""
    deadline = time.monotonic() + WORKER_GRACE_S
    while True:
        _reap()
        left = _workers(argv)
        if not left or time.monotonic() > deadline + 2.0:
            return
        if time.monotonic() > deadline:
            _kill(left)
        time.sleep(0.05)


def end_run(run_dir: str) -> NoReturn:
    """The controller is gone: remove the run's secrets, kill every process of the run, exit."""
    signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)
    shutil.rmtree(run_dir, ignore_errors=True)
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        family = _descendants(os.getpid())  # a killed process's children come back here (subreaper)
        if not family:
            break
        _kill(family)
        time.sleep(0.02)
        _reap()
    os._exit(ORPHANED_EXIT)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    options = dict(zip(argv[0:split:2], argv[1:split:2], strict=True))
    parent, run_dir = int(options["--parent"]), options["--run-dir"]

    def on_parent_signal(number: int, frame: object) -> None:
        if os.getppid() != parent:
            raise _Orphaned

    signal.signal(PARENT_DEATH_SIGNAL, on_parent_signal)
    _prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Ctrl-C reaches ansible-playbook too (same process group): the guard waits for it to stop. A handler, not
    # SIG_IGN, so that ansible-playbook starts with the default disposition again.
    signal.signal(signal.SIGINT, lambda number, frame: None)
    try:
        if os.getppid() != parent:
            raise _Orphaned  # the controller died before the guard could watch it
        run_mutex = os.open(options["--run-mutex"], os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(run_mutex, fcntl.LOCK_SH)
        try:
            child = subprocess.Popen(["ansible-playbook", *argv[split + 1:]], pass_fds=(run_mutex,),
                                     preexec_fn=_die_with_guard)
        except OSError as error:
            print(f"cannot start ansible-playbook: {error}", flush=True)
            return 127
        while True:
            try:
                code = child.wait(timeout=WATCH_INTERVAL_S)
                break
            except subprocess.TimeoutExpired:
                if os.getppid() != parent:
                    raise _Orphaned from None
        end_workers(argv[split + 1:])
        signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)  # the run is over: nothing left to kill
    except _Orphaned:
        end_run(run_dir)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
