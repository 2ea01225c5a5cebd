"""The one typed wrapper around ``ansible_runner.run()``; nothing else in the project calls it.

Each run gets a private data dir; events stream to a callback (the progress display); failures
come back as the project's own exceptions. Secrets never reach the artifacts: they are handed to
ansible-playbook as ``-e @file`` from a 0600 file outside the data dir, deleted after the run, and
the run gets an allow-listed environment, never the controller's own (ansible-runner records the
whole environment in ``artifacts/<id>/command``, and an operator's shell holds other boxes' keys).

SSH host keys are checked against the inventory's ``known_hosts`` (the file the probe records into),
strictly. Ctrl-C (or SIGTERM) during a run stops ansible-playbook (SIGINT to its process group, then
SIGKILL after a grace period) and raises RunInterrupted naming the last task started. One run at a
time per inventory folder (its mutex, controller.inventory.Inventory.mutex).

A controller killed outright (SIGKILL, the OOM killer) takes its run with it: ansible-playbook runs under
controller/stages/playbook_guard.py, which removes the run's private folder and kills the run when its parent dies,
and holds the inventory's run mutex with the run's processes, so a second controller waits for the last of
them. A private folder whose controller died anyway is removed when the next run starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller import COLLECTION
from controller.errors import RunError, TransportError
from controller.inventory import Inventory
from controller.stages.strategy import LINEAR
from controller.stages.strategy import environment as strategy_environment
from controller.stages.transports.known_hosts import forget_command

# The folder holding controller/ and ansible_collections/: a clone's root, or site-packages where a wheel put both.
PROJECT_ROOT = COLLECTION.parents[2]
PLAYBOOKS = COLLECTION / "playbooks"
GUARD = Path(__file__).resolve().parent / "playbook_guard.py"
# Every run's Ansible settings, shipped in the package: a run reads no ansible.cfg of a clone, the user or the system.
RUN_CONFIG = Path(__file__).resolve().parents[1] / "data" / "ansible.cfg"
RUN_FOLDER_PREFIX = "v100box-run-"
UNMARKED_RUN_FOLDER_AGE_S = 3600  # a run folder without its owner's mark: an older controller's, or just begun

EventHandler = Callable[[dict[str, Any]], None]

# What ansible-playbook may see of the controller's environment; everything else (API keys, WinRM
# passwords, tokens of other boxes) stays out of the run and its artifacts.
ALLOWED_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "SSH_AUTH_SOCK",
                         "KRB5CCNAME", "KRB5_CONFIG"})
ALLOWED_ENV_PREFIXES = ("LC_",)
INTERRUPTED_EXIT = 130
STOP_GRACE_S = 10.0  # after Ctrl-C, ansible-playbook gets this long to stop before it is killed


@dataclass
class HostStats:
    ok: int = 0
    changed: int = 0
    failures: int = 0
    unreachable: int = 0
    skipped: int = 0
    rescued: int = 0
    ignored: int = 0


@dataclass
class FailedTask:
    host: str
    task: str
    message: str
    unreachable: bool = False


@dataclass
class RunResult:
    playbook: str
    status: str
    rc: int
    elapsed: float
    stats: dict[str, HostStats] = field(default_factory=dict)
    failed: list[FailedTask] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # what the play published with set_stats
    artifact_dir: Path | None = None
    last_task: str | None = None  # the last task started ("host: task" where a host started it)
    strategy: str = LINEAR  # the Ansible strategy it ran under (controller.stages.strategy)

    @property
    def changed(self) -> int:
        return sum(s.changed for s in self.stats.values())


HIDDEN = "output hidden because the task handles a secret (no_log)"


def _hidden(res: Mapping[str, Any]) -> bool:
    return bool(res.get("_ansible_no_log")) or "censored" in res


def _failure_message(res: Mapping[str, Any]) -> str:
    if _hidden(res):
        return HIDDEN
    looped = _failed_item(res)
    if looped is not None:
        return looped
    message = res.get("msg") or res.get("stderr") or res.get("reason") or "failed"
    return str(message).strip().splitlines()[0][:400] if str(message).strip() else "failed"


def _item_label(result: Mapping[str, Any], number: int) -> str:
    """The loop item as Ansible names it (loop_control's label); an item without one by its ``name``, or its place
    (a whole item may hold what the label was chosen to leave out)."""
    label = result.get("_ansible_item_label", result.get(result.get("ansible_loop_var") or "item"))
    if isinstance(label, Mapping):
        label = label.get("name")
    if label is None or isinstance(label, list | Mapping) or not str(label).strip():
        return f"#{number}"
    return str(label).strip().splitlines()[0][:120]


def _failed_item(res: Mapping[str, Any]) -> str | None:
    """A failed loop ("One or more items failed"): the first item that failed and why, and how many more did."""
    results = res.get("results")
    if not isinstance(results, list):
        return None
    items = [(number, result) for number, result in enumerate(results, 1) if isinstance(result, Mapping)]
    failed = [(number, result) for number, result in items if result.get("failed") and not _hidden(result)]
    hidden = [number for number, result in items if _hidden(result)]  # Ansible drops a hidden item's "failed"
    if not failed:
        return f"an item failed: {HIDDEN}" if hidden else None
    number, first = failed[0]
    more = len(failed) - 1
    others = f" (and {more} more item{'s' if more > 1 else ''})" if more else ""
    return f"item {_item_label(first, number)}: {_failure_message(first)}{others}"


class _VerbatimDumper(yaml.SafeDumper):
    """Secrets as ``!unsafe`` strings: Ansible passes a key holding ``{{`` on verbatim, never evaluates it."""


_VerbatimDumper.add_representer(str, lambda dumper, data: dumper.represent_scalar("!unsafe", data))


class _UnsafeText(str):
    """A secret's value in a host-secrets inventory: written ``!unsafe`` (host and variable names stay plain)."""


class _HostSecretsDumper(yaml.SafeDumper):
    pass


_HostSecretsDumper.add_representer(_UnsafeText, lambda dumper, data: dumper.represent_scalar("!unsafe", str(data)))


def _unsafe(value: Any) -> Any:
    if isinstance(value, str):
        return _UnsafeText(value)
    if isinstance(value, Mapping):
        return {key: _unsafe(item) for key, item in value.items()}
    return value


class RunInterrupted(RunError):
    """Ctrl-C (or SIGTERM) stopped a run; ``result`` says how far it got."""

    exit_code = INTERRUPTED_EXIT

    def __init__(self, message: str, result: RunResult):
        super().__init__(message)
        self.result = result


def allowed_environ(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items()
            if key in ALLOWED_ENV or key.startswith(ALLOWED_ENV_PREFIXES)}


@contextlib.contextmanager
def _only_environ(keep: Mapping[str, str]) -> Iterator[None]:
    """ansible-runner seeds the run's environment from os.environ: show it only ``keep`` meanwhile."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(keep)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def ssh_env(inventory: Path) -> dict[str, str]:
    """Host keys checked strictly against the inventory's known_hosts, the file the probe records into.

    ANSIBLE_SSH_ARGS comes before any ansible_ssh_common_args on ssh's command line, and ssh keeps the
    first value of an option, so inventory variables cannot turn the check off.
    """
    known = shlex.quote(str(Inventory(inventory.resolve()).known_hosts_file))
    return {
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_SSH_ARGS": f"-o ControlMaster=auto -o ControlPersist=60s -o StrictHostKeyChecking=yes "
                            f"-o UserKnownHostsFile={known} -o GlobalKnownHostsFile=/dev/null",
    }


def _host_key_problem(host: str, message: str, inventory: Path) -> str | None:
    """A one-line reason for ssh's host-key refusals, which Ansible reports as a wall of @ signs."""
    known = Inventory(inventory.resolve()).known_hosts_file
    changed = re.search(r"Host key for (\S+) has changed", message)
    if changed:
        name = changed.group(1)
        sent = re.search(r"fingerprint for the (\S+) key sent by the remote host is\s*(SHA256:[A-Za-z0-9+/=]+)", message)
        offending = re.search(r"Offending \S+ key in (.+):(\d+)", message)
        now = f" presents {sent.group(1).lower()} {sent.group(2)}," if sent else ""
        at = f"{offending.group(1)} line {offending.group(2)}" if offending else str(known)
        return (f"box {host}: host key refused by Ansible: the box{now} not the key recorded in {at} (someone may "
                f"be intercepting the connection); if the box was reinstalled, accept its new key with: "
                f"{forget_command(name, known)}")
    if "Host key verification failed" in message:
        return (f"box {host}: host key refused by Ansible: no key for it in {known}; run `controller probe {host}` "
                f"(it records the key on first contact) or set host_key in the fleet file")
    if "SSH reported an unrecognized or mismatching host key" in message:  # mitogen's words (its own ssh reader)
        return (f"box {host}: host key refused by Ansible: the box does not present the key recorded for it in "
                f"{known} (someone may be intercepting the connection); `controller probe {host}` shows the key it "
                f"presents now and the command that accepts it if the box was reinstalled")
    return None


class _Stopper:
    """Turns Ctrl-C (SIGINT) and SIGTERM during a run into a clean stop of ansible-playbook.

    ansible-runner polls ``__call__`` (its cancel_callback); True makes it SIGKILL the playbook's process
    group. The first signal asks ansible-playbook to stop (SIGINT to its own process group: it runs on
    a pty in its own session, so the terminal's Ctrl-C never reaches it) and allows STOP_GRACE_S; a
    second signal, or the end of the grace period, kills it.
    """

    def __init__(self) -> None:
        self.signals = 0
        self.since = 0.0
        self.groups: set[int] = set()  # the process groups told to stop
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stopper:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _on_signal(self, number: int, frame: object) -> None:
        self.signals += 1
        if self.signals == 1:
            self.since = time.monotonic()
            for pid in _child_process_groups():
                self.groups.add(pid)
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGINT)

    def __call__(self) -> bool:
        return self.signals > 1 or (self.signals == 1 and time.monotonic() - self.since > STOP_GRACE_S)

    def wait_stopped(self) -> None:
        """Return once no process of the stopped groups lives on.

        ansible-runner returns when ansible-playbook's main process ends; its forked workers (same
        command line, same group) may still be unwinding. They get the rest of the grace period, then
        SIGKILL, so an interrupted run leaves nothing behind.
        """
        deadline = self.since + STOP_GRACE_S
        while self.groups and _live_members(self.groups):
            if time.monotonic() > deadline:
                for group in self.groups:
                    with contextlib.suppress(OSError):
                        os.killpg(group, signal.SIGKILL)
                deadline = time.monotonic() + 2.0
            time.sleep(0.05)


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields after the command name) of every process in /proc."""
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            yield int(entry.parent.name), entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue


def _live_members(groups: set[int]) -> bool:
    """Whether a process that is not a zombie belongs to one of ``groups``."""
    return any(fields[0] != "Z" and int(fields[2]) in groups for _pid, fields in _proc_stats())


def _child_process_groups() -> list[int]:
    """This process's children that lead their own process group (ansible-runner's pexpect child)."""
    me = os.getpid()
    return [pid for pid, fields in _proc_stats() if int(fields[1]) == me and int(fields[2]) == pid]  # ppid, pgrp


def remove_stale_run_folders(root: Path | None = None) -> list[Path]:
    """Remove the private folders (secrets, ansible-runner's input) of runs whose controller died; return them.

    A run's controller holds ``.owner`` in its folder (a shared flock) and writes its pid there once it holds
    it; a folder whose ``.owner`` says a pid but nobody holds is a dead run's. A folder without that mark is
    left alone for an hour: a run that is just beginning has none yet, and the folders of older controllers
    (the same prefix, no mark) are removed after that.
    """
    root = root or Path(tempfile.gettempdir())
    removed = []
    for folder in root.glob(f"{RUN_FOLDER_PREFIX}*"):
        try:
            info = folder.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and _abandoned(folder, info.st_mtime):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _abandoned(folder: Path, modified: float) -> bool:
    unmarked_and_old = time.time() - modified > UNMARKED_RUN_FOLDER_AGE_S
    try:
        fd = os.open(folder / ".owner", os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return unmarked_and_old
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its controller is alive
    else:
        return os.fstat(fd).st_size > 0 or unmarked_and_old
    finally:
        os.close(fd)


@contextlib.contextmanager
def _run_folder() -> Iterator[Path]:
    """A private folder for one run, owner-only, removed after it (see ``remove_stale_run_folders``)."""
    remove_stale_run_folders()
    folder = Path(tempfile.mkdtemp(prefix=RUN_FOLDER_PREFIX))
    owner = os.open(folder / ".owner", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(owner, fcntl.LOCK_SH)
        os.write(owner, f"pid {os.getpid()}\n".encode())
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(owner)


def guard_command(inventory: Path, run_folder: Path) -> list[str]:
    """The arguments (after ``sys.executable``) that start ansible-playbook under controller/stages/playbook_guard.py:
    the ansible-playbook arguments follow them."""
    return ["-I", str(GUARD), "--parent", str(os.getpid()), "--run-mutex",
            str(Inventory(inventory.resolve()).run_mutex_file), "--run-dir", str(run_folder), "--"]


def base_env() -> dict[str, str]:
    # ansible-playbook lives beside this interpreter (a venv's bin/), which need not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    return {
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "/usr/bin:/bin")]),
        "ANSIBLE_CONFIG": str(RUN_CONFIG),
        # The roles, modules and filters are the collection v100box.llm in PROJECT_ROOT/ansible_collections; the
        # collections it depends on come from the `ansible` package beside this Python (Python's path, searched
        # after these), at its pinned versions: no user's or system's collections folder comes before them.
        "ANSIBLE_COLLECTIONS_PATH": str(PROJECT_ROOT),
        "ANSIBLE_NOCOLOR": "1",
        # Reruns reuse a box's facts (OS family, package manager) for a day instead of gathering them
        # again; the cache is <inventory>/facts (run_playbook passes it as fact_cache).
        "ANSIBLE_GATHERING": "smart",
        "ANSIBLE_CACHE_PLUGIN_TIMEOUT": "86400",
    }


def run_env(inventory: Path) -> dict[str, str]:
    """The whole environment of a run: the allow-listed part of the controller's, then the project's."""
    return {**allowed_environ(os.environ), **base_env(), **ssh_env(inventory)}


def unrescued(failed: list[FailedTask], stats: Mapping[str, HostStats]) -> list[FailedTask]:
    """The failures no rescue caught. Ansible reports a task that failed inside a block as failed even when the
    block's rescue then handled it; the host's stats count only the failures left, and those come last (a host
    stops at its first uncaught failure)."""
    kept = []
    for host in dict.fromkeys(task.host for task in failed):
        mine = [task for task in failed if task.host == host]
        counted = stats.get(host)
        if counted is not None and counted.rescued and not any(task.unreachable for task in mine):
            mine = mine[len(mine) - counted.failures:] if counted.failures else []
        kept += mine
    return kept


def run_playbook(
    playbook: str,
    *,
    inventory: Path,
    limit: str | None = None,
    extravars: Mapping[str, Any] | None = None,
    secrets: Mapping[str, str] | None = None,
    on_event: EventHandler | None = None,
    artifact_root: Path | None = None,
    timeout: int | None = None,
    host_secrets: Mapping[str, Mapping[str, Any]] | None = None,
    forks: int | None = None,
    raise_on_failure: bool = True,
    hosts_file: Path | None = None,
    strategy: str = LINEAR,
) -> RunResult:
    """Run ``playbooks/<playbook>`` and return its result; raise RunError or TransportError on failure,
    RunInterrupted on Ctrl-C (after ansible-playbook stopped).

    ``secrets`` go to every host of the run (extra vars); ``host_secrets`` (box -> variables) each to its
    own host only, as host variables of a private second inventory source (a fleet run: each box its own
    keys). ``forks``: Ansible's parallel hosts (default: ansible.cfg's). With ``raise_on_failure=False``
    a run that failed on some hosts comes back as its result (the caller reads each host's stats). ``strategy``:
    Ansible's plain ``linear`` or ``mitogen_linear`` (controller.stages.strategy).
    """
    import ansible_runner

    path = PLAYBOOKS / playbook
    if not path.is_file():
        raise RunError(f"playbook {path} does not exist")
    secrets = {key: value for key, value in (secrets or {}).items() if value}
    folder = Inventory(inventory)
    artifact_root = artifact_root or folder.artifacts_folder
    artifact_root.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {}
    failed: list[FailedTask] = []
    stats: dict[str, HostStats] = {}
    last_task: list[str] = []
    unreachable_output: dict[str, str] = {}  # ssh's whole message: its host-key lines come after the first

    def handle(event: dict[str, Any]) -> bool:
        name = event.get("event")
        event_data = event.get("event_data", {})
        if name in ("playbook_on_task_start", "runner_on_start") and event_data.get("task"):
            host = event_data.get("host")
            last_task[:] = [f"{host}: {event_data['task']}" if host else str(event_data["task"])]
        if name == "runner_on_unreachable":
            unreachable_output.setdefault(event_data.get("host", "?"), str(event_data.get("res", {}).get("msg", "")))
        if name in ("runner_on_failed", "runner_on_unreachable") and not event_data.get("ignore_errors"):
            failed.append(FailedTask(
                host=event_data.get("host", "?"),
                task=event_data.get("task", "?"),
                message=_failure_message(event_data.get("res", {})),
                unreachable=name == "runner_on_unreachable",
            ))
        elif name == "playbook_on_stats":
            data.update(event_data.get("artifact_data") or {})
            for key, attr in (("ok", "ok"), ("changed", "changed"), ("failures", "failures"),
                              ("dark", "unreachable"), ("skipped", "skipped"), ("rescued", "rescued"),
                              ("ignored", "ignored")):
                for host, count in (event_data.get(key) or {}).items():
                    setattr(stats.setdefault(host, HostStats()), attr, count)
        if on_event is not None:
            on_event(event)
        return True

    started = time.monotonic()
    env = run_env(inventory) | strategy_environment(strategy)
    with folder.mutex(f"ansible-playbook {playbook}"), _run_folder() as private, _Stopper() as stopper:
        cmdline = guard_command(inventory, private)
        # hosts.yml, or workstations.yml for playbooks/clients.yml; then, in a fleet run, the boxes' own secrets
        sources = [str((hosts_file or folder.hosts_file).resolve())]
        if secrets:
            secrets_file = private / "secrets.yml"
            fd = os.open(secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as secrets_out:
                yaml.dump(dict(secrets), secrets_out, Dumper=_VerbatimDumper)
            cmdline += ["-e", f"@{secrets_file}"]
        per_host = {host: {key: _unsafe(value) for key, value in values.items() if value}
                    for host, values in (host_secrets or {}).items()}
        if any(per_host.values()):
            secrets_hosts = private / "secrets-hosts.yml"
            fd = os.open(secrets_hosts, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as hosts_out:
                yaml.dump({"all": {"hosts": {host: values for host, values in per_host.items() if values}}},
                          hosts_out, Dumper=_HostSecretsDumper)
            sources.append(str(secrets_hosts))
        data_dir = private / "data"
        (data_dir / "env").mkdir(parents=True)
        (data_dir / "env" / "settings").write_text("pexpect_timeout: 1\n")  # how often a Ctrl-C is noticed
        cmdline.append(str(path))  # the guard is the binary, so ansible-runner leaves the playbook to us
        with _only_environ(env):
            runner = ansible_runner.run(
                private_data_dir=str(data_dir),
                artifact_dir=str(artifact_root),
                rotate_artifacts=20,
                binary=sys.executable,
                inventory=sources if len(sources) > 1 else sources[0],
                limit=limit,
                extravars=dict(extravars or {}),
                cmdline=shlex.join(cmdline),
                envvars=env,
                # Joined onto the run's artifact dir; an absolute path keeps one cache per inventory.
                fact_cache=str(folder.facts_folder.resolve()),
                fact_cache_type="jsonfile",
                event_handler=handle,
                quiet=True,
                timeout=timeout,
                forks=forks,
                suppress_env_files=True,
                cancel_callback=stopper,
            )
        stopper.wait_stopped()
    failed = unrescued(failed, stats)
    result = RunResult(
        playbook=playbook,
        status=runner.status,
        rc=runner.rc,
        elapsed=time.monotonic() - started,
        stats=stats,
        failed=failed,
        data=data,
        artifact_dir=Path(runner.config.artifact_dir),
        last_task=last_task[0] if last_task else None,
        strategy=strategy,
    )
    if stopper.signals:
        result.status = "interrupted"
        where = f" during task '{result.last_task}'" if result.last_task else " before its first task"
        raise RunInterrupted(f"{playbook} interrupted{where}; run the same command again to finish "
                             f"(artifacts: {result.artifact_dir})", result)
    if runner.status == "successful" or (not raise_on_failure and runner.status == "failed"):
        return result
    unreachable = [task for task in failed if task.unreachable]
    if unreachable:
        first = unreachable[0]
        raise TransportError(_host_key_problem(first.host, unreachable_output.get(first.host, ""), inventory)
                             or f"box {first.host}: unreachable from Ansible: {first.message}")
    if runner.status == "timeout":
        raise RunError(f"{playbook} did not finish within {timeout} s (artifacts: {result.artifact_dir})")
    lines = [f"{task.host}: task '{task.task}' failed: {task.message}" for task in failed]
    summary = "; ".join(lines) if lines else f"ansible-playbook exited {runner.rc}"
    error = RunError(f"{playbook} failed: {summary} (artifacts: {result.artifact_dir})")
    error.result = result  # type: ignore[attr-defined]
    raise error
