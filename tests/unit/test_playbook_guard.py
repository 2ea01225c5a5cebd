"""controller/stages/playbook_guard.py run for real around a stand-in ansible-playbook (a script of that name first on
PATH): when ansible-playbook has ended, the workers it forked into sessions of their own end too before the guard
exits, as after a Ctrl-C, when a worker may still be in the middle of its task."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from controller.stages import playbook_guard

# Forks a worker into a session of its own (as ansible-core's workers are), prints its pid and ends at once; the
# worker writes its marker file when its time is up, unless it was killed first.
STAND_IN = f"""#!{sys.executable}
import os, sys, time
worker = os.fork()
if worker == 0:
    os.setsid()
    time.sleep({{worker_seconds}})
    open({{marker!r}}, "w").close()
    os._exit(0)
print(worker, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _guard(tmp_path: Path, worker_seconds: float) -> tuple[subprocess.CompletedProcess[str], float]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "ansible-playbook"
    stand_in.write_text(STAND_IN.replace("{worker_seconds}", str(worker_seconds))
                        .replace("{marker!r}", repr(str(tmp_path / "worker-finished"))))
    stand_in.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-I", playbook_guard.__file__, "--parent", str(os.getpid()),
                           "--run-mutex", str(tmp_path / "mutex"), "--run-dir", str(run_dir), "--",
                           str(tmp_path / "site.yml"), "-i", "inventory"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    return done, time.monotonic() - started


def test_a_worker_still_running_when_ansible_playbook_ends_is_killed_before_the_guard_exits(tmp_path):
    done, took = _guard(tmp_path, 60)
    assert done.returncode == 0, done.stderr
    worker = int(done.stdout.split()[0])
    assert not _alive(worker), f"worker {worker} outlived the guard"
    assert not (tmp_path / "worker-finished").exists()
    assert playbook_guard.WORKER_GRACE_S <= took < playbook_guard.WORKER_GRACE_S + 10


def test_a_worker_that_ends_within_the_grace_is_waited_for_not_killed(tmp_path):
    done, took = _guard(tmp_path, 0.5)
    assert done.returncode == 0, done.stderr
    assert not _alive(int(done.stdout.split()[0]))
    assert (tmp_path / "worker-finished").exists()  # it ended by itself: waited for, not killed
    assert took >= 0.5
