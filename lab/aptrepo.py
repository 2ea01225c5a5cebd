"""A local flat apt repository of stand-in NVIDIA driver packages, for the nvidia_driver role's tests.

The lab has no GPU and cannot reach NVIDIA's CUDA repository, yet the role's package handling (the
branch pin, the dpkg hold, the proprietary-vs-open kernel module choice, the refusal of a driver outside
the R570-R580 window, NCCL) should run against real apt and dpkg. This builds .deb packages with the
real names and dependency structure of NVIDIA's Debian 12 repository, in several versions, and indexes
them as a flat repository (``Packages``, ``Packages.gz``, ``Release``) that apt reads as
``deb [trusted=yes] <url> /``:

* every driver version in :data:`DRIVER_VERSIONS` (one below the window, two inside it, one above it so
  that an unpinned apt would take it): ``nvidia-driver``, ``nvidia-kernel-dkms`` (proprietary modules),
  ``nvidia-kernel-open-dkms`` and the ``nvidia-open`` metapackage (open modules, which Volta cannot
  use), ``nvidia-smi``, ``libnvidia-ml1``, ``libcuda1``, ``nvidia-persistenced`` and ``nvidia-modprobe``;
* ``libnccl2`` for CUDA 12 and for CUDA 13, each with a real shared library ``libnccl.so.2``, compiled
  here with ``cc``, whose ``ncclGetVersion`` reports the package's version.

``nvidia-driver`` depends on ``nvidia-kernel-open-dkms | nvidia-kernel-dkms``, open first, so apt takes
the open modules unless the proprietary package is named: a role that forgets it installs the wrong one.
The stand-in ``nvidia-smi`` (Python) prints the GPUs of :data:`GPUS` (an ``/etc/nvidia-smi-standin/gpus.csv``
on the box replaces them) with its own package version as the driver version. The stand-in
``nvidia-modprobe`` (sh) loads nothing but makes the device nodes the real one makes, as character devices
with no driver behind them (in a privileged container; see :data:`NVIDIA_MODPROBE`). No package carries a
kernel module and no maintainer script does anything.

Built repositories are cached under ``~/.cache/v100-llm-box/aptrepo/<hash of the inputs>``.
``python -m lab.aptrepo build DIR`` writes one into DIR for use by hand.

Test harness only: never point a real box at this repository.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

from lab.engine_build import cache_root, sha256_file
from lab.host import cache_lock

DRIVER_VERSIONS = ("535.247.01-1", "570.195.03-1", "580.95.05-1", "595.45.04-1")
"""Driver package versions in the repository: below the window, the window's two ends, and above it."""

NCCL_VERSIONS = ("2.27.7-1+cuda12.9", "2.28.3-1+cuda13.0")
"""libnccl2 builds: the CUDA 12 one Volta can use and a newer CUDA 13 one (no sm_70) apt would prefer."""

GPUS = (
    ("0", "00000000:04:00.0", "Tesla V100-PCIE-32GB", "32768"),
    ("1", "00000000:1B:00.0", "Tesla V100-PCIE-32GB", "32768"),
)
"""index, pci.bus_id, name, memory.total (MiB) of the GPUs the stand-in nvidia-smi reports: the two cards
of ../shared/fixtures/real/smi-2xv100-pcie-32gb-linux-535-no-processes.txt (a public nvidia-smi table)."""

ARCH = "amd64"
LIB_DIR = "usr/lib/x86_64-linux-gnu"
STANDIN_GPUS = "usr/share/nvidia-smi-standin/gpus.csv"
FORMAT_VERSION = "1"  # bump when the package layout changes, so cached repositories are rebuilt

NCCL_SOURCE = """\
/* Stand-in for NVIDIA's NCCL: only the version query, reporting the version it was built as. */
typedef enum { ncclSuccess = 0, ncclInvalidArgument = 4 } ncclResult_t;
ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}
"""

NVIDIA_SMI = r'''#!/usr/bin/python3
"""Lab stand-in for nvidia-smi (lab.aptrepo): reports fixture GPUs, no GPU is touched."""
import csv
import os
import sys

VERSION = "@VERSION@"
FILES = ("/etc/nvidia-smi-standin/gpus.csv", "/@GPUS@")
KNOWN = ("index", "uuid", "name", "serial", "pci.bus_id", "memory.total", "compute_cap", "driver_version",
         "driver_model.current", "power.limit", "temperature.gpu", "persistence_mode")
UNITS = {"memory.total": "[MiB]", "power.limit": "[W]"}


def gpus():
    path = next(p for p in FILES if os.path.exists(p))
    with open(path, newline="") as handle:
        rows = [[cell.strip() for cell in row] for row in csv.reader(handle) if row]
    persistence = "Enabled" if os.path.exists("/run/nvidia-persistenced/socket") else "Disabled"
    return [{"index": r[0], "uuid": "GPU-00000000-0000-0000-0000-%012d" % int(r[0]), "name": r[2],
             "serial": "03230000000%02d" % int(r[0]), "pci.bus_id": r[1], "memory.total": r[3] + " MiB",
             "compute_cap": "7.0", "driver_version": VERSION, "driver_model.current": "[N/A]",
             "power.limit": "250.00 W", "temperature.gpu": "31", "persistence_mode": persistence} for r in rows]


def query(fields, fmt):
    wanted = [f.strip() for f in fields.split(",") if f.strip()]
    for name in wanted:
        if name not in KNOWN:
            print(f'Field "{name}" is not a valid field to query.', file=sys.stderr)
            return 2
    if "csv" not in fmt.split(","):
        print("Only CSV output is supported by --query-gpu.", file=sys.stderr)
        return 2
    if "noheader" not in fmt.split(","):
        print(", ".join(" ".join(filter(None, (name, UNITS.get(name)))) for name in wanted))
    for gpu in gpus():
        print(", ".join(gpu[name] for name in wanted))
    return 0


def table():
    print(f"| NVIDIA-SMI {VERSION}    Driver Version: {VERSION}    CUDA Version: 12.9 |")
    for gpu in gpus():
        print(f"|  {gpu['index']:>2}  {gpu['name']:<28} | {gpu['pci.bus_id']} | {gpu['memory.total']} |")
    return 0


def details():
    """nvidia-smi -q, the identity lines of each section only; each card's minor number is its index."""
    print("==============NVSMI LOG==============\n")
    print(f"{'Driver Version':<55}: {VERSION}\n{'CUDA Version':<55}: 12.9\n")
    print(f"{'Attached GPUs':<55}: {len(gpus())}")
    for gpu in gpus():
        print(f"GPU {gpu['pci.bus_id']}")
        for key, value in (("Product Name", gpu["name"]), ("GPU UUID", gpu["uuid"]), ("Minor Number", gpu["index"])):
            print(f"    {key:<51}: {value}")
    return 0


def main(args):
    options = dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)
    if not args:
        return table()
    if args == ["-q"]:
        return details()
    if "--query-gpu" in options:
        return query(options["--query-gpu"], options.get("--format", ""))
    if args in (["-pm", "1"], ["--persistence-mode=1"]):
        for gpu in gpus():
            print(f"Enabled persistence mode for GPU {gpu['pci.bus_id']}.")
        print("All done.")
        return 0
    if args == ["--version"]:
        print(f"NVIDIA-SMI version  : {VERSION}\nNVML version        : {VERSION.split('.')[0]}.{VERSION.split('.')[1]}")
        return 0
    print(f"stand-in nvidia-smi: unsupported arguments: {' '.join(args)}", file=sys.stderr)
    return 2


sys.exit(main(sys.argv[1:]))
'''

NVIDIA_MODPROBE = r"""#!/bin/sh
# Lab stand-in for nvidia-modprobe (lab.aptrepo): loads no module, makes the device nodes the real one makes
# (mode 0666): -c=N /dev/nvidiaN (N=255: /dev/nvidiactl) with nvidia's major 195; -u -c=N /dev/nvidia-uvm (N) and
# /dev/nvidia-uvm-tools (N+1) with the major /proc/devices gives nvidia-uvm, else 60, a major the kernel keeps for
# local use and never gives a driver. Without a driver behind them, opening one answers ENXIO where a device policy
# lets it through (EPERM where it does not). It needs a privileged container (CAP_MKNOD, an open device cgroup).
# Prints each node as "made" or "existed".
uvm=0 minors=""
while [ $# -gt 0 ]; do
  case "$1" in
    -u|--unified-memory) uvm=1 ;;
    -c=*|--create-nvidia-device-file=*) minors="$minors ${1#*=}" ;;
    -c|--create-nvidia-device-file) shift; minors="$minors $1" ;;
    *) echo "stand-in nvidia-modprobe: unsupported argument: $1" >&2; exit 1 ;;
  esac
  shift
done
uvm_major=$(awk '$2 == "nvidia-uvm" {print $1}' /proc/devices)
node() {
  if [ -e "$1" ]; then echo "$1 existed"; else mknod -m 666 "$1" c "$2" "$3" && echo "$1 made" || exit 1; fi
}
for minor in $minors; do
  if [ "$uvm" = 1 ]; then
    node /dev/nvidia-uvm "${uvm_major:-60}" "$minor"
    node /dev/nvidia-uvm-tools "${uvm_major:-60}" $((minor + 1))
  elif [ "$minor" = 255 ]; then
    node /dev/nvidiactl 195 255
  else
    node "/dev/nvidia$minor" 195 "$minor"
  fi
done
"""

PERSISTENCED = """#!/bin/sh
# Lab stand-in for nvidia-persistenced (lab.aptrepo): a harmless daemon holding a socket path.
mkdir -p /run/nvidia-persistenced && : > /run/nvidia-persistenced/socket
trap 'rm -f /run/nvidia-persistenced/socket; exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
"""

PERSISTENCED_UNIT = """[Unit]
Description=NVIDIA Persistence Daemon (lab stand-in)
After=syslog.target

[Service]
Type=simple
ExecStart=/usr/bin/nvidia-persistenced
ExecStopPost=/bin/rm -f /run/nvidia-persistenced/socket

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class Package:
    """One stand-in .deb: control fields and the files it installs (path -> (content, mode))."""

    name: str
    version: str
    description: str
    depends: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    section: str = "non-free/libs"

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version.replace(':', '%3a')}_{ARCH}.deb"

    def control(self) -> str:
        lines = [f"Package: {self.name}", f"Version: {self.version}", f"Architecture: {ARCH}",
                 "Maintainer: v100-llm-box lab <lab@localhost>", f"Section: {self.section}", "Priority: optional"]
        for key, values in (("Depends", self.depends), ("Conflicts", self.conflicts), ("Provides", self.provides)):
            if values:
                lines.append(f"{key}: {', '.join(values)}")
        lines.append(f"Description: {self.description} (lab stand-in)")
        lines.append(" Built by lab.aptrepo for tests; contains no driver.")
        return "\n".join(lines) + "\n"

    def fingerprint(self) -> dict[str, object]:
        return {
            "control": self.control(),
            "files": {path: [hashlib.sha256(data).hexdigest(), mode] for path, (data, mode) in sorted(self.files.items())},
            "links": dict(sorted(self.links.items())),
        }


def upstream(version: str) -> str:
    """'580.95.05-1' -> '580.95.05' (no epoch, no Debian revision)."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def gpus_csv(gpus: tuple[tuple[str, str, str, str], ...] = GPUS) -> str:
    return "".join(", ".join(row) + "\n" for row in gpus)


def driver_packages(version: str, gpus: tuple[tuple[str, str, str, str], ...] = GPUS) -> list[Package]:
    """The driver's packages at one version, depending on each other with exact versions like NVIDIA's."""
    up = upstream(version)
    same = f"(= {version})"
    doc = "usr/share/doc/{}/README.standin"

    def readme(name: str) -> dict[str, tuple[bytes, int]]:
        return {doc.format(name): (f"{name} {version}: lab stand-in, no driver inside.\n".encode(), 0o644)}

    smi = NVIDIA_SMI.replace("@VERSION@", up).replace("@GPUS@", STANDIN_GPUS)
    return [
        Package("nvidia-driver", version, "NVIDIA metapackage",
                depends=(f"nvidia-kernel-open-dkms {same} | nvidia-kernel-dkms {same}", f"nvidia-smi {same}",
                         f"libcuda1 {same}", f"libnvidia-ml1 {same}"),
                files=readme("nvidia-driver"), section="non-free/x11"),
        Package("nvidia-kernel-dkms", version, "NVIDIA binary kernel module DKMS source",
                conflicts=("nvidia-kernel-open-dkms",), provides=(f"nvidia-kernel-{up}",),
                files=readme("nvidia-kernel-dkms"), section="non-free/kernel"),
        Package("nvidia-kernel-open-dkms", version, "NVIDIA open kernel module DKMS source",
                conflicts=("nvidia-kernel-dkms",), provides=(f"nvidia-open-kernel-{up}",),
                files=readme("nvidia-kernel-open-dkms"), section="non-free/kernel"),
        Package("nvidia-open", version, "NVIDIA driver metapackage with the open kernel modules",
                depends=(f"nvidia-driver {same}", f"nvidia-kernel-open-dkms {same}"),
                files=readme("nvidia-open"), section="non-free/x11"),
        Package("libcuda1", version, "NVIDIA CUDA Driver Library", files=readme("libcuda1")),
        Package("libnvidia-ml1", version, "NVIDIA Management Library (NVML) runtime library",
                files=readme("libnvidia-ml1")),
        Package("nvidia-smi", version, "NVIDIA System Management Interface",
                depends=(f"libnvidia-ml1 {same}", "python3"),
                files={"usr/bin/nvidia-smi": (smi.encode(), 0o755), STANDIN_GPUS: (gpus_csv(gpus).encode(), 0o644)},
                section="non-free/utils"),
        Package("nvidia-persistenced", version, "daemon to maintain persistent software state in the NVIDIA driver",
                files={"usr/bin/nvidia-persistenced": (PERSISTENCED.encode(), 0o755),
                       "lib/systemd/system/nvidia-persistenced.service": (PERSISTENCED_UNIT.encode(), 0o644)},
                section="non-free/utils"),
        Package("nvidia-modprobe", version, "utility to load NVIDIA kernel modules and create device nodes",
                files={"usr/bin/nvidia-modprobe": (NVIDIA_MODPROBE.encode(), 0o755)}, section="non-free/utils"),
    ]


def nccl_code(version: str) -> int:
    """NCCL_VERSION_CODE as ncclGetVersion reports it: 2.27.7 -> 22707 (the scheme since NCCL 2.9)."""
    major, minor, patch = (int(part) for part in upstream(version).split(".")[:3])
    return major * 10000 + minor * 100 + patch


def compile_nccl(version: str, folder: Path) -> bytes:
    """Compile the stand-in libnccl.so.2 with the host's cc; returns the shared library's bytes."""
    source = folder / "nccl.c"
    source.write_text(NCCL_SOURCE)
    library = folder / f"libnccl-{nccl_code(version)}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", f"-DNCCL_VERSION_CODE={nccl_code(version)}",
                    "-Wl,-soname,libnccl.so.2", "-o", str(library), str(source)], check=True)
    return library.read_bytes()


def nccl_package(version: str, library: bytes) -> Package:
    real = f"{LIB_DIR}/libnccl.so.{upstream(version)}"
    return Package("libnccl2", version, "NVIDIA Collective Communication Library (NCCL) Runtime",
                   files={real: (library, 0o644)},
                   links={f"{LIB_DIR}/libnccl.so.2": f"libnccl.so.{upstream(version)}"})


def build_deb(package: Package, out_dir: Path, work: Path) -> Path:
    root = work / f"{package.name}-{package.version}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(package.control())
    for path, (data, mode) in package.files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)
    for path, points_to in package.links.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).symlink_to(points_to)
    for folder in [root, *root.rglob("*")]:
        if folder.is_dir() and not folder.is_symlink():
            folder.chmod(0o755)
    out = out_dir / package.filename
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(out)],
                   check=True, capture_output=True, text=True)
    return out


def _control_of(deb: Path) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb)], check=True, capture_output=True, text=True).stdout


def write_index(repo: Path) -> None:
    """Write Packages, Packages.gz and Release for the .deb files in ``repo`` (a flat repository)."""
    stanzas = []
    for deb in sorted(repo.glob("*.deb")):
        control = _control_of(deb).rstrip("\n")
        data = deb.read_bytes()
        stanzas.append(control + "\n" + "\n".join([
            f"Filename: ./{deb.name}",
            f"Size: {len(data)}",
            f"MD5sum: {hashlib.md5(data).hexdigest()}",
            f"SHA256: {hashlib.sha256(data).hexdigest()}",
        ]) + "\n")
    packages = "\n".join(stanzas).encode()
    (repo / "Packages").write_bytes(packages)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as compressed:
        compressed.write(packages)
    (repo / "Packages.gz").write_bytes(buffer.getvalue())
    sums = []
    for name in ("Packages", "Packages.gz"):
        data = (repo / name).read_bytes()
        sums.append((name, len(data), hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest()))
    release = [
        "Origin: v100-llm-box lab",
        "Label: stand-in NVIDIA driver packages",
        f"Architectures: {ARCH}",
        f"Date: {formatdate(0, usegmt=True)}",  # fixed: the same inputs give the same repository
        "MD5Sum:",
        *(f" {md5} {size} {name}" for name, size, md5, _ in sums),
        "SHA256:",
        *(f" {sha} {size} {name}" for name, size, _, sha in sums),
    ]
    (repo / "Release").write_text("\n".join(release) + "\n")


def all_packages(workdir: Path) -> list[Package]:
    packages = [pkg for version in DRIVER_VERSIONS for pkg in driver_packages(version)]
    for version in NCCL_VERSIONS:
        packages.append(nccl_package(version, compile_nccl(version, workdir)))
    return packages


def input_key() -> str:
    """Hash of everything a repository is built from (not of the compiled library, which cc may vary)."""
    inputs = {
        "format": FORMAT_VERSION,
        "drivers": [pkg.fingerprint() for version in DRIVER_VERSIONS for pkg in driver_packages(version)],
        "nccl": [NCCL_SOURCE, list(NCCL_VERSIONS)],
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _build_into(cached: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".build-") as tmp:
        staged, work = Path(tmp) / "repo", Path(tmp) / "work"
        staged.mkdir()
        work.mkdir()
        for package in all_packages(work):
            build_deb(package, staged, work)
        write_index(staged)
        if cached.exists():
            shutil.rmtree(cached)
        os.replace(staged, cached)


def build(dest: Path | None = None) -> Path:
    """Return a folder holding the built repository, from the cache when the inputs are unchanged.

    With ``dest``, the repository is copied there (created or replaced) and ``dest`` is returned.
    """
    cached = cache_root() / "aptrepo" / input_key()
    if not (cached / "Release").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with cache_lock(cached.parent / f".{cached.name}.lock"):  # the suite's workers share the cache
            if not (cached / "Release").is_file():
                _build_into(cached)
    if dest is None:
        return cached
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(cached, dest)
    return dest


def sources_line(url: str) -> str:
    """The apt sources line for this repository served at ``url``."""
    return f"deb [trusted=yes] {url.rstrip('/')}/ /"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.aptrepo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="write the stand-in repository into DIR")
    build_cmd.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    out = build(args.dir.resolve())
    debs = sorted(out.glob("*.deb"))
    print(f"{out}: {len(debs)} packages, Packages sha256 {sha256_file(out / 'Packages')}")
    print(f"serve it (python -m lab.fileserver {out}) and add: {sources_line('http://127.0.0.1:PORT')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
