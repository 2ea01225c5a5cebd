"""The lab's systemd targets: podman containers running systemd and sshd, started, reached and swept.

The container shares the host's network namespace: everything the roles install stays on
127.0.0.1, so the loopback file server is reachable from inside and the engine inside is reachable
from the host. The price is that ports are shared too: each target's sshd listens on its own free
loopback port, and the image ships sshd disabled so a container never grabs the host's port 22.

The host preparation is in ``lab.host``, the image in ``lab.image``; ``python -m lab.target_cli
image|up|down|status`` manages targets by hand.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import yaml

from lab.engine_build import cache_root
from lab.host import LabError, cache_lock, podman, require_tools
from lab.image import LABEL, ensure_image

OWNER_LABEL = "io.v100box.owner"
PORT_LABEL = "io.v100box.ssh-port"
KEY_LABEL = "io.v100box.ssh-key"
MANUAL_OWNER = "manual"
LOOPBACK = "127.0.0.1"
HOST_KEY_FILE = "/etc/ssh/ssh_host_ed25519_key.pub"


def free_port() -> int:
    """A loopback port free right now; targets share the host's ports, so never assume a fixed one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def ensure_keypair() -> Path:
    """An ed25519 keypair authorized on every target; returns the private key path."""
    folder = cache_root() / "ssh"
    key = folder / "id_ed25519"
    with cache_lock(folder / ".lock"):
        if key.is_file() and key.with_suffix(".pub").is_file():
            return key
        require_tools("ssh-keygen")
        folder.chmod(0o700)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            staged = Path(tmp) / "id_ed25519"
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "v100box-target", "-f", str(staged)],
                check=True,
            )
            os.replace(staged.with_suffix(".pub"), key.with_suffix(".pub"))
            os.replace(staged, key)
    return key


def owner_token(pid: int | None = None) -> str:
    """pid plus process start time, so a recycled pid does not keep a dead session's targets alive."""
    pid = pid or os.getpid()
    return f"pid:{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(owner: str) -> bool:
    if owner == MANUAL_OWNER:
        return True
    match = re.fullmatch(r"pid:(\d+):(\d*)", owner)
    return bool(match) and _start_time(int(match.group(1))) == match.group(2) != ""


@dataclass
class Target:
    """A started systemd container whose sshd listens on ``host:ssh_port``; stop() removes it."""

    name: str
    ssh_port: int
    key_path: Path | None
    image: str
    host: str = LOOPBACK
    user: str = "root"
    failed_units: list[str] = field(default_factory=list)
    _host_key: str = field(default="", init=False, repr=False)

    @classmethod
    def start(
        cls,
        name: str | None = None,
        ssh_port: int | None = None,
        pubkey_path: Path | None = None,
        *,
        image: str | None = None,
        owner: str | None = None,
        timeout: float = 90.0,
        cgroupns: str | None = None,
    ) -> Target:
        """Start a target and wait until systemd has booted and sshd answers.

        ``pubkey_path`` defaults to the lab keypair; its private half (the same path without
        ``.pub``) becomes ``key_path`` when it exists. ``owner`` is ``"manual"`` for targets that
        must outlive this process; by default the sweeper removes them once this process is gone.
        ``cgroupns="private"`` gives the container a cgroup namespace of its own: on a cgroup v1 host only then
        can its systemd put units into the v1 controllers, so that a unit's device policy is enforced.
        """
        image = image or ensure_image()
        if pubkey_path is None:
            pubkey_path = ensure_keypair().with_suffix(".pub")
        pubkey_path = Path(pubkey_path)
        if not pubkey_path.is_file():
            raise LabError(f"public key {pubkey_path} does not exist: pass an existing .pub file")
        private = pubkey_path.with_suffix("") if pubkey_path.suffix == ".pub" else None
        owner = owner or owner_token()
        attempts = 1 if ssh_port else 3  # a port picked by free_port() can be taken in between
        port = ssh_port
        for _ in range(attempts):
            target = cls(
                name=name or f"v100box-target-{secrets.token_hex(4)}",
                ssh_port=ssh_port or free_port(),
                key_path=private if private and private.is_file() else None,
                image=image,
            )
            port = target.ssh_port
            try:
                target._create(pubkey_path.read_text(), owner, cgroupns)
                podman("start", target.name, what=f"start container {target.name}")
                target._wait_until_ready(timeout)
                return target
            except _PortTaken:
                target.stop()
            except BaseException:
                target.stop()
                raise
        raise LabError(
            f"sshd could not bind {LOOPBACK}:{port}: something else listens there; pick another port"
        )

    def _create(self, pubkey: str, owner: str, cgroupns: str | None = None) -> None:
        podman(
            "create", "--name", self.name, "--hostname", self.name,
            "--label", f"{LABEL}=1", "--label", f"{OWNER_LABEL}={owner}",
            "--label", f"{PORT_LABEL}={self.ssh_port}", "--label", f"{KEY_LABEL}={self.key_path or ''}",
            "--privileged", "--systemd=always", "--network=host",
            *([f"--cgroupns={cgroupns}"] if cgroupns else []),
            # / shared, as systemd makes it on a real machine: LoadCredential= (API keys) needs it.
            self.image, "/bin/sh", "-c", "mount --make-rshared / && exec /sbin/init",
            what=f"create container {self.name}",
        )
        podman(
            "cp", "-", f"{self.name}:/",
            stdin=self._injected_files(pubkey), what=f"copy ssh config into {self.name}",
        )

    def _injected_files(self, pubkey: str) -> bytes:
        """authorized_keys, the loopback listen address and the link that enables sshd, as a tar stream."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            _add_dir(archive, "root/.ssh", 0o700)
            _add_file(archive, "root/.ssh/authorized_keys", pubkey.strip() + "\n", 0o600)
            _add_file(
                archive, "etc/ssh/sshd_config.d/10-v100box-listen.conf",
                f"ListenAddress {LOOPBACK}:{self.ssh_port}\n", 0o644,
            )
            link = tarfile.TarInfo("etc/systemd/system/multi-user.target.wants/ssh.service")
            link.type = tarfile.SYMTYPE
            link.linkname = "/lib/systemd/system/ssh.service"
            archive.addfile(link)
        return buffer.getvalue()

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = self._wait_for_systemd(deadline)
        if state == "degraded":
            self.failed_units = self.list_failed_units()
            if "ssh.service" in self.failed_units:
                journal = self.run(["journalctl", "-u", "ssh", "-n", "20", "--no-pager"]).stdout
                if "Address already in use" in journal or "Cannot bind" in journal:
                    raise _PortTaken()
                raise LabError(f"sshd failed in {self.name}:\n{journal}")
        elif state != "running":
            raise LabError(
                f"systemd in {self.name} is {state!r}, not running; failed units: "
                f"{', '.join(self.list_failed_units()) or 'none'}"
            )
        self._wait_for_ssh(deadline)

    def _wait_for_systemd(self, deadline: float) -> str:
        state = "unknown"
        while time.monotonic() < deadline:
            result = subprocess.run(
                ["podman", "exec", self.name, "systemctl", "is-system-running", "--wait"],
                capture_output=True, text=True, check=False, timeout=max(1.0, deadline - time.monotonic()),
            )
            state = result.stdout.strip() or "unreachable"
            if state in ("running", "degraded", "maintenance", "stopping"):
                return state
            if not self.is_running():
                raise LabError(f"container {self.name} exited during boot:\n{self.logs()}")
            time.sleep(0.1)
        raise LabError(f"systemd in {self.name} did not finish booting in time (last state {state!r})")

    def _wait_for_ssh(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.ssh_port), timeout=2) as sock:
                    banner = sock.recv(64)
                if banner.startswith(b"SSH-"):
                    return
                last = repr(banner)
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise LabError(f"sshd in {self.name} did not answer on {self.host}:{self.ssh_port} ({last})")

    def list_failed_units(self) -> list[str]:
        result = self.run(["systemctl", "--failed", "--plain", "--no-legend"])
        return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]

    def run(
        self, command: str | Sequence[str], *, input: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the container (a string goes through ``sh -c``); never raises on failure."""
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        return subprocess.run(
            ["podman", "exec", *(["-i"] if input is not None else []), self.name, *argv],
            input=input, capture_output=True, text=True, check=False, timeout=timeout,
        )

    def exec(self, command: str | Sequence[str], *, input: str | None = None, timeout: float = 300) -> str:
        """Run a command inside the container and return its stdout; a non-zero exit raises LabError."""
        result = self.run(command, input=input, timeout=timeout)
        if result.returncode != 0:
            shown = command if isinstance(command, str) else " ".join(command)
            raise LabError(
                f"`{shown}` failed in {self.name} (exit {result.returncode}): {result.stderr.strip()}"
            )
        return result.stdout

    @property
    def key(self) -> Path:
        """The private key that logs in as root (the lab key unless another pubkey was given)."""
        if self.key_path is None:
            raise LabError(f"{self.name} was started with a public key whose private half is unknown")
        return self.key_path

    def host_public_key(self) -> str:
        """The container's SSH host key ("ssh-ed25519 AAAA..."), read through podman rather than over the
        SSH connection it vouches for; give it to a fleet file as ``host_key``."""
        if not self._host_key:
            self._host_key = " ".join(self.exec(["cat", HOST_KEY_FILE]).split()[:2])
        return self._host_key

    def new_host_key(self, timeout: float = 60.0) -> str:
        """Give sshd a new host key, as a reinstalled box (or an impostor on its address) would have; the
        container restarts, which also ends every open SSH session. Returns the new public key."""
        self.exec("rm -f /etc/ssh/ssh_host_*")
        podman("restart", "--time", "2", self.name, what=f"restart container {self.name}")
        self._wait_until_ready(timeout)
        self._host_key = ""
        return self.host_public_key()

    def known_hosts(self) -> Path:
        """The lab's known_hosts file, holding this target's current host key (one entry per port)."""
        from controller.stages.transports.known_hosts import entry_name, parse_public_key, record

        path = cache_root() / "ssh" / "known_hosts"
        record(path, entry_name(self.host, self.ssh_port), parse_public_key(self.host_public_key(), self.name),
               replace=True)
        return path

    def ssh_argv(self, *command: str) -> list[str]:
        """An ``ssh`` command line that logs in as root with the lab key and checks the host key."""
        options = ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts()}",
                   "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes"]
        key = ["-i", str(self.key_path)] if self.key_path else []
        return ["ssh", *key, *options, "-p", str(self.ssh_port), f"{self.user}@{self.host}", *command]

    def fleet_entry(self) -> dict[str, str | int]:
        """How a fleet file's box reaches this target over SSH: its address, port, user and key."""
        return {"address": self.host, "port": self.ssh_port, "user": self.user, "key": str(self.key)}

    def ansible_host_vars(self) -> dict[str, str | int]:
        """Inventory variables that reach this target over SSH."""
        variables: dict[str, str | int] = {
            "ansible_host": self.host,
            "ansible_port": self.ssh_port,
            "ansible_user": self.user,
            "ansible_python_interpreter": "/usr/bin/python3",
            "ansible_ssh_common_args": f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={self.known_hosts()}",
        }
        if self.key_path:
            variables["ansible_ssh_private_key_file"] = str(self.key_path)
        return variables

    def is_running(self) -> bool:
        result = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Running}}", self.name],
            capture_output=True, text=True, check=False,
        )
        return result.stdout.strip() == "true"

    def logs(self) -> str:
        result = subprocess.run(
            ["podman", "logs", "--tail", "40", self.name], capture_output=True, text=True, check=False
        )
        return (result.stdout + result.stderr).strip()

    def stop(self) -> None:
        """Remove the container; a short grace period, so lingering SSH sessions cannot stall it."""
        remove_containers([self.name])

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@contextmanager
def started(image: str, names: Sequence[str]) -> Iterator[dict[str, Target]]:
    """One target per name, started one after another; every one is removed on exit."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(Target.start(image=image)) for name in names}


def role_play(name: str, roles: Sequence[str]) -> str:
    """A playbook that runs the collection's ``roles`` in order on every target, after gathering the facts the
    Linux roles read (the distribution and its package manager), as playbooks/site.yml does."""
    return yaml.safe_dump([{
        "name": name, "hosts": "all", "gather_facts": False,
        "pre_tasks": [{"name": "Gather the facts the roles read", "ansible.builtin.setup": {
            "gather_subset": ["!all", "!min", "distribution", "pkg_mgr"]}}],
        "roles": [{"role": f"v100box.llm.{role}"} for role in roles],
    }], sort_keys=False)


class _PortTaken(Exception):
    """sshd lost the race for its loopback port; start() retries with another."""


def _add_dir(archive: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    archive.addfile(info)


def _add_file(archive: tarfile.TarFile, name: str, text: str, mode: int) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    archive.addfile(info, io.BytesIO(data))


@dataclass(frozen=True)
class TargetRecord:
    """A labelled container as podman lists it: enough for the sweeper and ``status``."""

    name: str
    state: str
    owner: str
    ssh_port: str
    key_path: str


def list_targets() -> list[TargetRecord]:
    if shutil.which("podman") is None:
        return []
    result = podman("ps", "--all", "--filter", f"label={LABEL}", "--format", "json", what="list targets")
    records = []
    for item in json.loads(result.stdout or "[]"):
        labels = item.get("Labels") or {}
        records.append(TargetRecord(
            name=item["Names"][0], state=item.get("State", ""), owner=labels.get(OWNER_LABEL, ""),
            ssh_port=labels.get(PORT_LABEL, ""), key_path=labels.get(KEY_LABEL, ""),
        ))
    return records


def remove_containers(names: Sequence[str]) -> None:
    if names:
        podman("rm", "--force", "--ignore", "--time", "2", *names, what=f"remove {', '.join(names)}")


def cleanup_stale(*, include_manual: bool = False) -> list[str]:
    """Remove targets whose owning process is gone (and manual ones when asked); returns their names."""
    stale = [
        record.name for record in list_targets()
        if (include_manual and record.owner == MANUAL_OWNER) or not owner_alive(record.owner)
    ]
    for name in stale:
        try:
            remove_containers([name])
        except LabError:
            if container_exists(name):  # another session's sweeper may have removed it meanwhile
                raise
    return stale


def container_exists(name: str) -> bool:
    return subprocess.run(["podman", "container", "exists", name], check=False).returncode == 0
