"""controller.stages.runner with real ansible-playbook runs against this machine (connection local).

The environment a run sees is allow-listed (foreign secrets in the controller's shell never reach the
artifacts), Ctrl-C stops a run cleanly with exit code 130 and says where, and two controllers on one
inventory take turns instead of interleaving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from controller.stages.runner import RunInterrupted, run_env, run_playbook

pytestmark = pytest.mark.slow  # each test runs ansible-playbook (a few seconds)

REPO = Path(__file__).resolve().parents[2]
FOREIGN = {"FOO_API_KEY": "sk-foreign-box-key-5150", "WIN1_PASSWORD": "Winrm-Pa55-of-another-box",
           "HF_TOKEN": "hf_operator_shell_token_0042"}


def local_inventory(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {"here": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    return folder


def playbook(folder: Path, tasks: str) -> Path:
    path = folder / "play.yml"
    path.write_text("- name: Test play\n  hosts: all\n  gather_facts: false\n  tasks:\n"
                    + textwrap.indent(textwrap.dedent(tasks), "    "))
    return path


def test_a_run_sees_only_the_allow_listed_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in FOREIGN.items():
        monkeypatch.setenv(key, value)
    inventory = local_inventory(tmp_path / "inventory")
    seen = tmp_path / "env.txt"
    play = playbook(tmp_path, f"""\
        - name: Record the environment ansible-playbook was given
          ansible.builtin.copy:
            content: "[{{{{ lookup('ansible.builtin.env', 'FOO_API_KEY', default='') }}}}]"
            dest: {seen}
            mode: "0600"
        """)
    result = run_playbook(str(play), inventory=inventory)
    assert result.status == "successful" and result.artifact_dir is not None
    assert seen.read_text() == "[]"  # the variable was not there for ansible-playbook to read
    files = [path for path in result.artifact_dir.rglob("*") if path.is_file()]
    assert any(path.name == "command" for path in files)  # ansible-runner's record of the environment
    for path in [*files, *(inventory / "facts").rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            for value in FOREIGN.values():
                assert value.encode() not in data, (path, value)
    # The run still gets what it needs: PATH, HOME, the locale, and strict host-key checking.
    env = run_env(inventory)
    assert set(FOREIGN).isdisjoint(env) and env["HOME"] == os.environ["HOME"]
    assert "StrictHostKeyChecking=yes" in env["ANSIBLE_SSH_ARGS"] and env["ANSIBLE_HOST_KEY_CHECKING"] == "True"
    assert f"UserKnownHostsFile={inventory.resolve()}/known_hosts" in env["ANSIBLE_SSH_ARGS"]


RUN_SCRIPT = """\
import sys
from pathlib import Path
from controller.stages.runner import run_playbook, RunInterrupted
try:
    run_playbook(sys.argv[1], inventory=Path(sys.argv[2]))
except RunInterrupted as exc:
    print(exc, file=sys.stderr)
    sys.exit(exc.exit_code)
"""


SLEEP = "119.25"  # an odd duration, to find this test's sleep among the machine's processes


def ansible_playbook_pids(play: Path) -> set[int]:
    """ansible-playbook processes running ``play`` (other sessions may run their own at the same time)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"ansible-playbook") for part in argv[:2]) and str(play).encode() in argv:
            found.add(int(cmdline.parent.name))
    return found


def test_ctrl_c_stops_the_run_says_where_and_leaves_no_process(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inventory")
    marker = tmp_path / "sleeping"
    play = playbook(tmp_path, f"""\
        - name: Say the first task ran
          ansible.builtin.command: touch {marker}
          changed_when: false
        - name: Wait for a long time
          ansible.builtin.command: sleep {SLEEP}
          changed_when: false
        - name: Never reached
          ansible.builtin.command: "true"
          changed_when: false
        """)
    process = subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, str(play), str(inventory)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the long task has started
    assert ansible_playbook_pids(play)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert time.monotonic() - started < 15
    assert "play.yml interrupted during task 'here: Wait for a long time'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    time.sleep(0.5)
    assert ansible_playbook_pids(play) == set()
    sleepers = subprocess.run(["pgrep", "-fx", f"sleep {SLEEP}"], check=False, capture_output=True,
                              text=True)
    assert sleepers.stdout.strip() == ""


def test_an_interrupted_run_in_process_reports_the_task(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inventory")
    play = playbook(tmp_path, f"""\
        - name: Interrupt the controller, as Ctrl-C would
          ansible.builtin.command: kill -INT {os.getpid()}
          changed_when: false
        - name: Wait to be stopped
          ansible.builtin.command: sleep 60
          changed_when: false
        """)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(RunInterrupted) as caught:
        run_playbook(str(play), inventory=inventory)
    assert caught.value.exit_code == 130
    assert caught.value.result.status == "interrupted"
    assert caught.value.result.last_task in ("here: Interrupt the controller, as Ctrl-C would",
                                             "here: Wait to be stopped")
    assert signal.getsignal(signal.SIGINT) is handler  # the controller's own handler is back


LOCKED_SCRIPT = """\
import sys
from pathlib import Path
from controller.stages.runner import run_playbook
run_playbook(sys.argv[1], inventory=Path(sys.argv[2]))
"""


def test_two_runs_on_one_inventory_take_turns(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inventory")
    log = tmp_path / "log"
    play = playbook(tmp_path, f"""\
        - name: Start
          ansible.builtin.shell: echo start >> {log}; sleep 3; echo end >> {log}
          changed_when: false
        """)
    first = subprocess.Popen([sys.executable, "-c", LOCKED_SCRIPT, str(play), str(inventory)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (inventory / ".lock").exists() or not (inventory / ".lock").read_text().strip():
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.1)
    second = subprocess.run([sys.executable, "-c", LOCKED_SCRIPT, str(play), str(inventory)], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    first.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert f"inventory {inventory.resolve()} is in use by pid {first.pid} (ansible-playbook {play})" \
           in second.stderr
    assert log.read_text().split() == ["start", "end", "start", "end"]  # never interleaved


def test_a_secret_holding_a_template_arrives_verbatim(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inventory")
    marker, seen = tmp_path / "evaluated", tmp_path / "key.txt"
    key = "{{ lookup('ansible.builtin.pipe', 'touch " + str(marker) + "') }}-0123456789"
    play = playbook(tmp_path, f"""\
        - name: Write the key the run was given
          ansible.builtin.copy:
            content: "{{{{ llama_service_api_key }}}}"
            dest: {seen}
            mode: "0600"
        """)
    run_playbook(str(play), inventory=inventory, secrets={"llama_service_api_key": key})
    assert not marker.exists()
    assert seen.read_text() == key


def test_a_stopped_group_that_ignores_ctrl_c_is_killed_after_the_grace_period() -> None:
    """A worker left behind by ansible-playbook (same group, deaf to SIGINT) does not outlive the run."""
    from controller.stages import runner

    deaf = subprocess.Popen(["sh", "-c", "trap '' INT; sleep 60"], start_new_session=True)
    try:
        stopper = runner._Stopper()
        stopper.groups.add(deaf.pid)
        stopper.since = time.monotonic() - runner.STOP_GRACE_S  # the grace period is over
        started = time.monotonic()
        stopper.wait_stopped()
        assert time.monotonic() - started < 5
        assert deaf.wait(timeout=5) == -signal.SIGKILL
    finally:
        if deaf.poll() is None:
            deaf.kill()


def test_a_failure_a_rescue_caught_is_not_named_as_one():
    from controller.stages.runner import FailedTask, HostStats, unrescued

    caught = FailedTask(host="box1", task="Check each server", message="HTTP 501", unreachable=False)
    final = FailedTask(host="box1", task="Fail with the rollback", message="rolled back", unreachable=False)
    other = FailedTask(host="box2", task="Check each server", message="HTTP 500", unreachable=False)
    stats = {"box1": HostStats(failures=1, rescued=1), "box2": HostStats(failures=1)}
    assert unrescued([caught, other, final], stats) == [final, other]
    assert unrescued([caught], {"box1": HostStats(rescued=1)}) == []  # rescued and done: nothing failed
    assert unrescued([caught, final], {}) == [caught, final]  # no stats (a stopped run): everything, as seen


# The event ansible-core 2.19.14 sent for a get_url loop over two files against a closed loopback port (each
# item's `invocation` left out); what `run_playbook` names as the failure comes from it.
FAILED_LOOP = {
    "results": [
        {"url": "http://127.0.0.1:9/a.gguf", "dest": "/tmp/loopx/a.gguf", "elapsed": 0, "failed": True,
         "msg": "Request failed: <urlopen error [Errno 111] Connection refused>", "changed": False,
         "exception": "(traceback unavailable)", "_ansible_no_log": False,
         "item": {"name": "a.gguf", "token": "s3cr3t"}, "ansible_loop_var": "item", "_ansible_item_label": "a.gguf"},
        {"url": "http://127.0.0.1:9/b.gguf", "dest": "/tmp/loopx/b.gguf", "elapsed": 0, "failed": True,
         "msg": "Request failed: <urlopen error [Errno 111] Connection refused>", "changed": False,
         "exception": "(traceback unavailable)", "_ansible_no_log": False,
         "item": {"name": "b.gguf"}, "ansible_loop_var": "item", "_ansible_item_label": "b.gguf"},
    ],
    "msg": "One or more items failed",
    "changed": False,
}
# The same ansible-core's whole result of a loop whose `no_log` depends on the item (`no_log: "{{ ... }}"`).
CENSORED = {"censored": "the output has been hidden due to the fact that 'no_log: true' was specified for this result"}


def test_a_failed_loop_is_named_by_its_item_and_its_cause() -> None:
    from controller.stages.runner import _failure_message

    assert _failure_message(FAILED_LOOP) == ("item a.gguf: Request failed: <urlopen error [Errno 111] Connection "
                                             "refused> (and 1 more item)")
    ok, disk_full = dict(FAILED_LOOP["results"][1], failed=False), {
        "failed": True, "msg": "[Errno 28] No space left on device\nTraceback ...", "item": "model-q4.gguf",
        "ansible_loop_var": "item"}
    assert _failure_message({**FAILED_LOOP, "results": [ok, disk_full]}) == \
        "item model-q4.gguf: [Errno 28] No space left on device"
    unlabelled = {"failed": True, "msg": "boom", "__pack": {"url": "http://127.0.0.1/p.tar", "sha256": "0" * 64},
                  "ansible_loop_var": "__pack"}
    assert _failure_message({**FAILED_LOOP, "results": [ok, unlabelled]}) == "item #2: boom"  # never a whole dict


def test_a_failed_loop_that_handles_a_secret_stays_hidden() -> None:
    from controller.stages.runner import HIDDEN, _failure_message

    assert _failure_message(CENSORED) == HIDDEN
    assert _failure_message({**FAILED_LOOP, "_ansible_no_log": True}) == HIDDEN
    hidden_item = {"changed": False, "_ansible_no_log": True, **CENSORED}
    assert _failure_message({**FAILED_LOOP, "results": [hidden_item]}) == f"an item failed: {HIDDEN}"
    message = _failure_message({**FAILED_LOOP, "results": [hidden_item, FAILED_LOOP["results"][1]]})
    assert message.startswith("item b.gguf: Request failed") and "s3cr3t" not in message


def test_a_failed_download_loop_says_which_file_and_why(tmp_path: Path) -> None:
    import socket

    from controller.errors import RunError

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    inventory = local_inventory(tmp_path / "inventory")
    play = playbook(tmp_path, f"""\
        - name: Download the model files
          ansible.builtin.get_url:
            url: "http://127.0.0.1:{port}/{{{{ item.name }}}}"
            dest: "{tmp_path}/{{{{ item.name }}}}"
            mode: "0644"
            timeout: 5
          loop: [{{name: small.gguf}}, {{name: big.gguf}}]
          loop_control:
            label: "{{{{ item.name }}}}"
        """)
    with pytest.raises(RunError) as failed:
        run_playbook(str(play), inventory=inventory)
    message = str(failed.value)
    assert "here: task 'Download the model files' failed: item small.gguf: Request failed: " in message
    assert "Connection refused" in message and "One or more items failed" not in message
    assert len(message.splitlines()) == 1


def test_run_folders_of_dead_controllers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    from controller.stages.runner import UNMARKED_RUN_FOLDER_AGE_S, remove_stale_run_folders

    def folder(name: str, owner: str | None, age: float = 0) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "secrets.yml").write_text("llama_service_api_key: sk-0451\n")
        if owner is not None:
            (path / ".owner").write_text(owner)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    dead = folder("v100box-run-dead", "pid 4242\n")
    beginning = folder("v100box-run-beginning", "")  # its controller has not marked it yet
    older = folder("v100box-run-older", None, age=UNMARKED_RUN_FOLDER_AGE_S + 60)  # an older controller's
    fresh = folder("v100box-run-fresh", None)
    other = folder("someone-elses", "pid 4242\n")
    alive = folder("v100box-run-alive", "pid 4343\n")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"fd = open({str(alive / '.owner')!r})\nfcntl.flock(fd, fcntl.LOCK_SH)\n"
                               "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert sorted(remove_stale_run_folders(tmp_path)) == sorted([dead, older])
        assert not dead.exists() and not older.exists()
        assert beginning.is_dir() and fresh.is_dir() and other.is_dir() and alive.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_run_folders(tmp_path) == [alive]
