"""A real Linux target for tests and the demo: a podman container running systemd and sshd.

No image registry is reachable from the lab, so the image is built from a debootstrap'd Debian
rootfs. The rootfs tarball is cached outside the clone (``~/.cache/v100-llm-box/rootfs/<key>.tar``)
and keyed by everything that shapes it, so only the first run pays for debootstrap; later runs
``podman import`` it, or reuse the image when its tag already exists.

The container shares the host's network namespace: everything the roles install stays on
127.0.0.1, so the loopback file server is reachable from inside and the engine inside is reachable
from the host. The price is that ports are shared too: each target's sshd listens on its own free
loopback port, and the image ships sshd disabled so a container never grabs the host's port 22.

Run as ``python -m controller.lab.target image|up|down|status`` for manual use.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import click

from controller.errors import ControllerError
from controller.lab.engine_build import cache_root

SUITE = "bookworm"
VARIANT = "minbase"
# What Ansible's modules and the roles expect on a Debian box, on top of systemd and sshd:
# python3-apt for ansible.builtin.apt, acl for become_user, xz/unzip for unarchive, passwd for user.
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-apt", "sudo",
    "ca-certificates", "tar", "gzip", "unzip", "xz-utils", "procps", "iproute2", "curl", "acl",
    "passwd", "less",
)
# Units that would reach through a privileged, host-networked container into the host
# (sysctl, kernel modules, binfmt, fstrim), that wait for hardware a container lacks (getty, udev),
# or that start surprise work in the background (apt timers).
MASKED_UNITS = (
    "getty.target", "getty@.service", "console-getty.service", "serial-getty@.service",
    "systemd-udevd.service", "systemd-udevd-control.socket", "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service", "systemd-udev-settle.service",
    "systemd-sysctl.service", "systemd-modules-load.service", "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount", "proc-sys-fs-binfmt_misc.mount",
    "sys-kernel-config.mount", "sys-kernel-debug.mount", "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount", "dev-hugepages.mount", "systemd-remount-fs.service", "modprobe@.service",
    "systemd-journald-audit.socket", "systemd-pstore.service", "e2scrub_reap.service",
    "e2scrub_all.timer", "fstrim.timer", "apt-daily.timer", "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
)
SSHD_DROP_IN = """\
# Written by controller.lab.target: key-only root login; the listen address comes per container.
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
MaxStartups 50:30:100
"""
# Each container makes its own host key at first start (ed25519 takes milliseconds) instead of
# every target sharing the one baked into the tarball.
SSH_SERVICE_DROP_IN = """\
[Service]
ExecStartPre=
ExecStartPre=/bin/sh -c 'test -s /etc/ssh/ssh_host_ed25519_key || \\
    ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/ssh_host_ed25519_key'
ExecStartPre=/usr/sbin/sshd -t
"""
# Bump when configure_rootfs() changes in a way the constants above do not show.
CONFIG_VERSION = "1"

IMAGE_REPO = "localhost/v100box-target"
# A stable tag for tools that cannot compute the key (molecule's shared platform config).
STABLE_TAG = f"{IMAGE_REPO}:latest"
IMAGE_ENV = "V100BOX_TARGET_IMAGE"
MIRROR_ENV = "V100BOX_DEBIAN_MIRROR"

LABEL = "io.v100box.target"
OWNER_LABEL = "io.v100box.owner"
PORT_LABEL = "io.v100box.ssh-port"
KEY_LABEL = "io.v100box.ssh-key"
MANUAL_OWNER = "manual"

CONTAINERS_CONF = Path("/etc/containers/containers.conf")
DEFAULT_ULIMITS = {"nofile": "nofile=20000:20000", "nproc": "nproc=32768:32768"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
LOOPBACK = "127.0.0.1"
HOST_KEY_FILE = "/etc/ssh/ssh_host_ed25519_key.pub"
HOST_PACKAGES = "podman crun netavark debootstrap debian-archive-keyring openssh-client"


class LabError(ControllerError):
    """The lab's systemd target could not be built, started or reached."""


class LabUnavailable(LabError):
    """This machine lacks what the target needs (podman, debootstrap, root); tests may skip locally."""


# ---------------------------------------------------------------------------------------------
# Host preparation
# ---------------------------------------------------------------------------------------------


def require_tools(*tools: str) -> None:
    """Fail early, naming the Debian packages to install, instead of a FileNotFoundError later."""
    if sys.platform != "linux":
        raise LabUnavailable("the systemd target needs a Linux host with podman")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise LabUnavailable(
            f"{', '.join(missing)} not found: install the host packages with "
            f"`apt-get install {HOST_PACKAGES}`"
        )
    if os.geteuid() != 0:
        raise LabUnavailable("the systemd target needs rootful podman: run as root")


def ensure_host_ready() -> None:
    """Apply the two host fixes podman needs on this kind of machine; safe to call every time."""
    require_tools("podman")
    ensure_default_ulimits(CONTAINERS_CONF)
    ensure_v1_controllers(CGROUP_ROOT)


def ensure_default_ulimits(path: Path) -> bool:
    """Merge nofile/nproc into [containers] default_ulimits; returns whether the file changed.

    Podman's default RLIMIT_NOFILE is above this host's hard limit (20000), so crun fails with
    ``setrlimit RLIMIT_NOFILE: Operation not permitted`` unless containers.conf lowers it.
    """
    text = path.read_text() if path.exists() else ""
    try:
        current = tomllib.loads(text).get("containers", {}).get("default_ulimits", [])
    except tomllib.TOMLDecodeError as exc:
        raise LabError(f"{path} is not valid TOML ({exc}): fix it, then rerun") from exc
    wanted = merged_ulimits(current)
    if wanted == current:
        return False
    new_text = set_containers_ulimits(text, wanted)
    if tomllib.loads(new_text).get("containers", {}).get("default_ulimits") != wanted:
        raise LabError(
            f"could not edit {path} safely: set default_ulimits = {wanted!r} under [containers] by hand"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".v100box-tmp")
    staged.write_text(new_text)
    os.replace(staged, path)
    return True


def merged_ulimits(current: Sequence[str]) -> list[str]:
    """Keep the operator's other ulimits; replace only the ones podman trips over."""
    kept = [item for item in current if item.split("=", 1)[0].strip() not in DEFAULT_ULIMITS]
    return kept + list(DEFAULT_ULIMITS.values())


def set_containers_ulimits(text: str, ulimits: Sequence[str]) -> str:
    """Rewrite one key of containers.conf without touching the rest of the file (comments included)."""
    assignment = "default_ulimits = [\n" + "".join(f'  "{item}",\n' for item in ulimits) + "]\n"
    lines = text.splitlines(keepends=True)
    start = _section_start(lines, "containers")
    if start is None:
        prefix = text if not text or text.endswith("\n") else text + "\n"
        return prefix + ("\n" if prefix else "") + "[containers]\n" + assignment
    end = _section_end(lines, start)
    for index in range(start + 1, end):
        if re.match(r"\s*default_ulimits\s*=", lines[index]):
            stop = _value_end(lines, index)
            return "".join(lines[:index] + [assignment] + lines[stop:])
    return "".join(lines[: start + 1] + [assignment] + lines[start + 1:])


def _section_start(lines: Sequence[str], name: str) -> int | None:
    for index, line in enumerate(lines):
        if re.match(rf"\s*\[\s*{re.escape(name)}\s*\]\s*(#.*)?$", line):
            return index
    return None


def _section_end(lines: Sequence[str], start: int) -> int:
    for index in range(start + 1, len(lines)):
        if re.match(r"\s*\[", lines[index]):
            return index
    return len(lines)


def _value_end(lines: Sequence[str], first: int) -> int:
    """Index after the last line of an array value that may span lines (brackets outside strings)."""
    depth = 0
    for index in range(first, len(lines)):
        in_string = False
        for char in lines[index]:
            if char == '"':
                in_string = not in_string
            elif in_string:
                continue
            elif char == "#":
                break
            elif char == "[":
                depth += 1
            elif char == "]":
                depth -= 1
        if depth <= 0:
            return index + 1
    raise LabError("default_ulimits in containers.conf has an unclosed array: fix it by hand")


def ensure_v1_controllers(root: Path) -> list[str]:
    """Mount, as cgroup v1, every controller still bound to the unified hierarchy of a hybrid host.

    crun refuses such hosts (``cgroups in hybrid mode not supported, drop all controllers from
    cgroupv2``); here the one left over is hugetlb. Returns the controllers it mounted.
    """
    unified = root / "unified" / "cgroup.controllers"
    if _fs_type(root) == "cgroup2" or not unified.exists():
        return []  # pure v2 or pure v1: nothing to fix
    mounted: list[str] = []
    for controller in unified.read_text().split():
        if controller in v1_mounted_controllers():
            continue
        point = root / controller
        point.mkdir(exist_ok=True)
        result = subprocess.run(
            ["mount", "-t", "cgroup", "-o", controller, "cgroup", str(point)],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise LabError(
                f"could not mount the {controller} cgroup controller as v1 at {point}: "
                f"{result.stderr.strip()} (run `mount -t cgroup -o {controller} cgroup {point}` as root)"
            )
        mounted.append(controller)
    return mounted


def v1_mounted_controllers() -> set[str]:
    """Controllers mounted as cgroup v1 anywhere, read from the super options in mountinfo."""
    found: set[str] = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        _, _, tail = line.partition(" - ")
        parts = tail.split()
        if len(parts) >= 3 and parts[0] == "cgroup":
            found.update(parts[2].split(","))
    return found


def _fs_type(path: Path) -> str:
    result = subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=False
    )
    return result.stdout.strip()


# ---------------------------------------------------------------------------------------------
# Image
# ---------------------------------------------------------------------------------------------


def image_key() -> str:
    """Hash of everything that shapes the rootfs; a change in any of it builds a new image."""
    digest = hashlib.sha256()
    for part in (SUITE, VARIANT, *PACKAGES, *MASKED_UNITS, SSHD_DROP_IN, SSH_SERVICE_DROP_IN, CONFIG_VERSION):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:12]


def image_tag() -> str:
    return f"{IMAGE_REPO}:{image_key()}"


def rootfs_tarball_path() -> Path:
    return cache_root() / "rootfs" / f"{image_key()}.tar"


def ensure_image() -> str:
    """Return the image tag, importing the cached rootfs (or building it first) when missing.

    Also points ``STABLE_TAG`` at it, because molecule's platform config cannot compute the key.
    """
    ensure_host_ready()
    tag = image_tag()
    with _lock(cache_root() / "rootfs" / f"{image_key()}.lock"):
        if not image_exists(tag):
            tarball = ensure_rootfs_tarball()
            _podman(
                "import",
                "--change", 'CMD ["/sbin/init"]',
                "--change", "STOPSIGNAL SIGRTMIN+3",
                "--change", f"LABEL {LABEL}.image={image_key()}",
                str(tarball), tag,
                what=f"import {tarball}",
            )
        _podman("tag", tag, STABLE_TAG, what=f"tag {tag} as {STABLE_TAG}")
    return tag


def image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], check=False).returncode == 0


def ensure_rootfs_tarball() -> Path:
    """Build the configured rootfs tarball once; debootstrap is the slow, network-bound part."""
    target = rootfs_tarball_path()
    if target.is_file():
        return target
    require_tools("debootstrap")
    target.parent.mkdir(parents=True, exist_ok=True)
    debs = cache_root() / "debs" / SUITE
    debs.mkdir(parents=True, exist_ok=True)
    log_path = target.with_suffix(".log")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        root = Path(tmp) / "root"
        try:
            run_debootstrap(root, debian_mirror(), debs, log_path)
            configure_rootfs(root)
            staged = Path(tmp) / "rootfs.tar"
            packed = subprocess.run(
                ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(root),
                 "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "-cf", str(staged), "."],
                capture_output=True, text=True, check=False,
            )
            if packed.returncode != 0:
                raise LabError(f"could not pack the rootfs into {staged}: {packed.stderr.strip()}")
            os.replace(staged, target)
        finally:
            _unmount_below(root)  # a failed debootstrap can leave /proc and /sys mounted in the chroot
    return target


def run_debootstrap(root: Path, mirror: str, debs: Path, log_path: Path) -> None:
    command = [
        "debootstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}",
        f"--cache-dir={debs}", SUITE, str(root), mirror,
    ]
    print(f"building the target rootfs ({SUITE}, a few minutes); log: {log_path}", file=sys.stderr)
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise LabError(
            f"debootstrap failed (exit {result.returncode}) with mirror {mirror}; check the mirror "
            f"or set {MIRROR_ENV}. Last lines of {log_path}:\n{tail}"
        )


def _unmount_below(root: Path) -> None:
    prefix = str(root.resolve()) + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(prefix):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


def debian_mirror() -> str:
    """The Debian mirror this host's apt uses (or ``$V100BOX_DEBIAN_MIRROR``): never hard-coded."""
    if os.environ.get(MIRROR_ENV):
        return os.environ[MIRROR_ENV]
    entries = apt_source_entries()
    for uri, suites, components in entries:
        if SUITE in suites and "main" in components:
            return uri
    for uri, _suites, components in entries:
        if "main" in components and uri.rstrip("/").endswith("/debian"):
            return uri
    raise LabUnavailable(
        f"no Debian mirror found in /etc/apt/sources.list*: set {MIRROR_ENV} to a mirror URL "
        f"that serves {SUITE}"
    )


def apt_source_entries(etc_apt: Path = Path("/etc/apt")) -> list[tuple[str, list[str], list[str]]]:
    """(uri, suites, components) of every binary package source, one-line and deb822 formats."""
    entries: list[tuple[str, list[str], list[str]]] = []
    listed = sorted(Path(p) for p in glob.glob(str(etc_apt / "sources.list.d/*.list")))
    one_line = [etc_apt / "sources.list", *listed]
    for path in one_line:
        if path.is_file():
            entries.extend(_parse_one_line_sources(path.read_text()))
    for path in sorted(Path(p) for p in glob.glob(str(etc_apt / "sources.list.d/*.sources"))):
        entries.extend(_parse_deb822_sources(path.read_text()))
    return [entry for entry in entries if not entry[0].startswith("cdrom:")]


def _parse_one_line_sources(text: str) -> list[tuple[str, list[str], list[str]]]:
    entries = []
    for raw in text.splitlines():
        line = re.sub(r"\[[^\]]*\]", " ", raw.split("#", 1)[0]).split()
        if len(line) >= 3 and line[0] == "deb":
            entries.append((line[1], [line[2]], line[3:]))
    return entries


def _parse_deb822_sources(text: str) -> list[tuple[str, list[str], list[str]]]:
    entries = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
            continue
        for uri in fields.get("uris", "").split():
            entries.append((uri, fields.get("suites", "").split(), fields.get("components", "").split()))
    return entries


def configure_rootfs(root: Path) -> None:
    """Turn a bare debootstrap tree into a target: quiet systemd, key-only sshd, per-boot machine-id."""
    systemd = root / "etc/systemd/system"
    for unit in MASKED_UNITS:
        link = systemd / unit
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("/dev/null")
    for wants in systemd.glob("*.wants/*"):
        if wants.name in MASKED_UNITS or wants.name.startswith("getty@"):
            wants.unlink()
    # sshd starts only where Target enables it with a loopback port: with host networking an
    # enabled sshd would bind the host's port 22 in every molecule container.
    (systemd / "multi-user.target.wants/ssh.service").unlink(missing_ok=True)
    (root / "etc/ssh/sshd_config.d/00-v100box.conf").write_text(SSHD_DROP_IN)
    drop_in = systemd / "ssh.service.d"
    drop_in.mkdir(parents=True, exist_ok=True)
    (drop_in / "v100box.conf").write_text(SSH_SERVICE_DROP_IN)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    # An empty machine-id makes systemd generate a fresh one on every boot of every container.
    (root / "etc/machine-id").write_text("")
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    (root / "etc/default/locale").write_text("LANG=C.UTF-8\n")
    for cached in (root / "var/cache/apt").glob("*.bin"):
        cached.unlink()
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    (root / "etc/v100box-target").write_text(f"{image_key()}\n")


# ---------------------------------------------------------------------------------------------
# Containers
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port free right now; targets share the host's ports, so never assume a fixed one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def ensure_keypair() -> Path:
    """An ed25519 keypair authorized on every target; returns the private key path."""
    folder = cache_root() / "ssh"
    key = folder / "id_ed25519"
    with _lock(folder / ".lock"):
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
    ) -> Target:
        """Start a target and wait until systemd has booted and sshd answers.

        ``pubkey_path`` defaults to the lab keypair; its private half (the same path without
        ``.pub``) becomes ``key_path`` when it exists. ``owner`` is ``"manual"`` for targets that
        must outlive this process; by default the sweeper removes them once this process is gone.
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
                target._create(pubkey_path.read_text(), owner)
                _podman("start", target.name, what=f"start container {target.name}")
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

    def _create(self, pubkey: str, owner: str) -> None:
        _podman(
            "create", "--name", self.name, "--hostname", self.name,
            "--label", f"{LABEL}=1", "--label", f"{OWNER_LABEL}={owner}",
            "--label", f"{PORT_LABEL}={self.ssh_port}", "--label", f"{KEY_LABEL}={self.key_path or ''}",
            "--privileged", "--systemd=always", "--network=host",
            # / shared, as systemd makes it on a real machine: LoadCredential= (API keys) needs it.
            self.image, "/bin/sh", "-c", "mount --make-rshared / && exec /sbin/init",
            what=f"create container {self.name}",
        )
        _podman(
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
        _podman("restart", "--time", "2", self.name, what=f"restart container {self.name}")
        self._wait_until_ready(timeout)
        self._host_key = ""
        return self.host_public_key()

    def known_hosts(self) -> Path:
        """The lab's known_hosts file, holding this target's current host key (one entry per port)."""
        from controller.transports.known_hosts import entry_name, parse_public_key, record

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
    result = _podman("ps", "--all", "--filter", f"label={LABEL}", "--format", "json", what="list targets")
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
        _podman("rm", "--force", "--ignore", "--time", "2", *names, what=f"remove {', '.join(names)}")


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


def _podman(*args: str, what: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], input=stdin, capture_output=True, check=False)
    if result.returncode != 0:
        raise LabError(f"podman could not {what}: {result.stderr.decode(errors='replace').strip()}")
    return subprocess.CompletedProcess(result.args, 0, result.stdout.decode(errors="replace"), "")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Serialize builds across processes (parallel test sessions share the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@click.group(name="target")
def cli() -> None:
    """Manage the lab's systemd target containers."""


@cli.command()
def image() -> None:
    """Build or import the target image (also tagged :latest for molecule) and print its tag."""
    click.echo(ensure_image())


@cli.command()
@click.option("--name", help="Container name (default: a random v100box-target-* name).")
@click.option("--port", type=int, help="Loopback port for sshd (default: a free one).")
def up(name: str | None, port: int | None) -> None:
    """Start a target that stays up until `down`, and print how to reach it."""
    target = Target.start(name=name, ssh_port=port, owner=MANUAL_OWNER)
    click.echo(f"{target.name} is up; ssh with:")
    click.echo("  " + " ".join(target.ssh_argv()))


@cli.command()
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Remove every lab target, including other sessions' ones.")
def down(names: tuple[str, ...], all_: bool) -> None:
    """Remove the named targets (default: manual ones and those whose owner is gone)."""
    if all_:
        removed = [record.name for record in list_targets()]
        remove_containers(removed)
    elif names:
        known = {record.name for record in list_targets()}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise click.ClickException(f"not a lab target: {', '.join(unknown)} (see `status`)")
        removed = list(names)
        remove_containers(removed)
    else:
        removed = cleanup_stale(include_manual=True)
    click.echo("removed: " + (", ".join(removed) or "nothing"))


@cli.command()
def status() -> None:
    """List lab targets with their ssh command."""
    records = list_targets()
    if not records:
        click.echo("no lab targets")
    for record in records:
        key = f"-i {record.key_path} " if record.key_path else ""
        click.echo(
            f"{record.name}  {record.state}  owner={record.owner}  "
            f"ssh {key}-p {record.ssh_port} root@{LOOPBACK}"
        )


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(1)
    except ControllerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
