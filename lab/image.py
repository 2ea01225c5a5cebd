"""The target image: a debootstrap'd Debian rootfs made into a systemd box, cached and imported into podman.

No image registry is reachable from the lab, so the image is built from a debootstrap'd Debian
rootfs. The rootfs tarball is cached outside the clone (``~/.cache/v100-llm-box/rootfs/<key>.tar``)
and keyed by everything that shapes it, so only the first run pays for debootstrap; later runs
``podman import`` it, or reuse the image when its tag already exists.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from lab.engine_build import cache_root
from lab.host import LabError, LabUnavailable, cache_lock, ensure_host_ready, podman, require_tools

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
# Written by lab.image: key-only root login; the listen address comes per container.
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
    with cache_lock(cache_root() / "rootfs" / f"{image_key()}.lock"):
        if not image_exists(tag):
            tarball = ensure_rootfs_tarball()
            podman(
                "import",
                "--change", 'CMD ["/sbin/init"]',
                "--change", "STOPSIGNAL SIGRTMIN+3",
                "--change", f"LABEL {LABEL}.image={image_key()}",
                str(tarball), tag,
                what=f"import {tarball}",
            )
        podman("tag", tag, STABLE_TAG, what=f"tag {tag} as {STABLE_TAG}")
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
