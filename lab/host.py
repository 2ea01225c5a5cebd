"""The machine that runs the lab's targets: the tools it needs, the two fixes rootful podman needs here,
and the podman call and cross-process lock the image and the containers share."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

from controller.errors import ControllerError
from lab.engine_build import cache_root

CONTAINERS_CONF = Path("/etc/containers/containers.conf")
DEFAULT_ULIMITS = {"nofile": "nofile=20000:20000", "nproc": "nproc=32768:32768"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
HOST_PACKAGES = "podman crun netavark debootstrap debian-archive-keyring openssh-client"


class LabError(ControllerError):
    """The lab's systemd target could not be built, started or reached."""


class LabUnavailable(LabError):
    """This machine lacks what the target needs (podman, debootstrap, root); tests may skip locally."""



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


def debian_packages(group: str, names: Sequence[str]) -> Path:
    """A folder of Debian 12 packages (``apt-get download NAMES``), fetched once on this machine into
    ~/.cache/v100-llm-box/debs/<group>, for a target to install with dpkg or a test to unpack."""
    folder = cache_root() / "debs" / group
    folder.mkdir(parents=True, exist_ok=True)
    with cache_lock(folder / ".lock"):  # the suite's workers share the cache
        _download_debs(folder, names)
    return folder


def _download_debs(folder: Path, names: Sequence[str]) -> None:
    if len(list(folder.glob("*.deb"))) < len(names):
        done = subprocess.run(["apt-get", "download", *names], cwd=folder, capture_output=True, text=True, check=False)
        if done.returncode != 0:  # package lists older than the archive: refresh them once
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False, timeout=300)
            done = subprocess.run(["apt-get", "download", *names], cwd=folder, capture_output=True, text=True,
                                  check=False)
        if done.returncode != 0:
            raise LabError(f"apt-get download {' '.join(names)} failed: {done.stderr.strip()}")


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


def podman(*args: str, what: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], input=stdin, capture_output=True, check=False)
    if result.returncode != 0:
        raise LabError(f"podman could not {what}: {result.stderr.decode(errors='replace').strip()}")
    return subprocess.CompletedProcess(result.args, 0, result.stdout.decode(errors="replace"), "")


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Serialize builds across processes (parallel test sessions share the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

