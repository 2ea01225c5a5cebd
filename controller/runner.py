"""The one typed wrapper around ``ansible_runner.run()``; nothing else in the project calls it.

Each run gets a private data dir; events stream to a callback (the progress display); failures
come back as the project's own exceptions. Secrets never reach the artifacts: they are handed to
ansible-playbook as ``-e @file`` from a 0600 file outside the data dir, deleted after the run, and
any environment variable holding a secret is withheld from the run's environment (ansible-runner
records the whole environment in ``artifacts/<id>/command``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller.errors import RunError, TransportError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PLAYBOOKS = PROJECT_ROOT / "playbooks"

EventHandler = Callable[[dict[str, Any]], None]


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

    @property
    def changed(self) -> int:
        return sum(s.changed for s in self.stats.values())


def _failure_message(res: Mapping[str, Any]) -> str:
    if res.get("_ansible_no_log"):
        return "output hidden because the task handles a secret (no_log)"
    message = res.get("msg") or res.get("stderr") or res.get("reason") or "failed"
    return str(message).strip().splitlines()[0][:400] if str(message).strip() else "failed"


@contextlib.contextmanager
def _environ_without(values: set[str]) -> Iterator[None]:
    hidden = {key: value for key, value in os.environ.items() if value and value in values}
    for key in hidden:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(hidden)


def base_env() -> dict[str, str]:
    # ansible-playbook lives beside this interpreter (a venv's bin/), which need not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    return {
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "/usr/bin:/bin")]),
        "ANSIBLE_CONFIG": str(PROJECT_ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(PROJECT_ROOT / "roles"),
        "ANSIBLE_LIBRARY": str(PROJECT_ROOT / "plugins" / "modules"),
        "ANSIBLE_FILTER_PLUGINS": str(PROJECT_ROOT / "plugins" / "filter"),
        "ANSIBLE_NOCOLOR": "1",
        # Reruns reuse a box's facts (OS family, package manager) for a day instead of gathering them
        # again; the cache is <inventory>/facts (run_playbook passes it as fact_cache).
        "ANSIBLE_GATHERING": "smart",
        "ANSIBLE_CACHE_PLUGIN_TIMEOUT": "86400",
    }


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
) -> RunResult:
    """Run ``playbooks/<playbook>`` and return its result; raise RunError or TransportError on failure."""
    import ansible_runner

    path = PLAYBOOKS / playbook
    if not path.is_file():
        raise RunError(f"playbook {path} does not exist")
    secrets = {key: value for key, value in (secrets or {}).items() if value}
    artifact_root = artifact_root or inventory / "artifacts"
    artifact_root.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {}
    failed: list[FailedTask] = []
    stats: dict[str, HostStats] = {}

    def handle(event: dict[str, Any]) -> bool:
        name = event.get("event")
        event_data = event.get("event_data", {})
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
    with tempfile.TemporaryDirectory(prefix="v100box-run-") as private, _environ_without(set(secrets.values())):
        cmdline = []
        if secrets:
            secrets_file = Path(private) / "secrets.yml"
            fd = os.open(secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as secrets_out:
                yaml.safe_dump(dict(secrets), secrets_out)
            cmdline = ["-e", f"@{secrets_file}"]
        data_dir = Path(private) / "data"
        data_dir.mkdir()
        runner = ansible_runner.run(
            private_data_dir=str(data_dir),
            artifact_dir=str(artifact_root),
            rotate_artifacts=20,
            playbook=str(path),
            inventory=str((inventory / "hosts.yml").resolve()),
            limit=limit,
            extravars=dict(extravars or {}),
            cmdline=shlex.join(cmdline) if cmdline else None,
            envvars=base_env(),
            # Joined onto the run's artifact dir; an absolute path keeps one cache per inventory.
            fact_cache=str((inventory / "facts").resolve()),
            fact_cache_type="jsonfile",
            event_handler=handle,
            quiet=True,
            timeout=timeout,
            suppress_env_files=True,
        )
    result = RunResult(
        playbook=playbook,
        status=runner.status,
        rc=runner.rc,
        elapsed=time.monotonic() - started,
        stats=stats,
        failed=failed,
        data=data,
        artifact_dir=Path(runner.config.artifact_dir),
    )
    if runner.status == "successful":
        return result
    unreachable = [task for task in failed if task.unreachable]
    if unreachable:
        first = unreachable[0]
        raise TransportError(f"box {first.host}: unreachable from Ansible: {first.message}")
    if runner.status == "timeout":
        raise RunError(f"{playbook} did not finish within {timeout} s (artifacts: {result.artifact_dir})")
    lines = [f"{task.host}: task '{task.task}' failed: {task.message}" for task in failed]
    summary = "; ".join(lines) if lines else f"ansible-playbook exited {runner.rc}"
    error = RunError(f"{playbook} failed: {summary} (artifacts: {result.artifact_dir})")
    error.result = result  # type: ignore[attr-defined]
    raise error
