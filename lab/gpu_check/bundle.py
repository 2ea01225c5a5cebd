"""What an offline GPU machine needs for the check, made on a machine that reaches the package indexes.

``python -m lab.gpu_check prepare out/gpu-check-bundle`` writes:

* ``llama.cpp-src.tar.xz``: the pinned sdist's llama.cpp tree, slimmed (the sdist itself is 73 MiB);
* ``wheels/``: the Python packages the product's parsers import that a CUDA image may lack (pydantic and its
  compiled core for the target's Python, ansible-core for the modules' ``module_utils``), at the versions locked here;
* ``strace-root/``: Debian's strace and the library it links, unpacked (``apt-get download``, ``dpkg -x``);
* ``llama.service``: the llama_service unit rendered by Ansible for one instance on GPU 0;
* ``syscall-filter.txt``: ``systemd-analyze syscall-filter``, to resolve the unit's groups where systemd is absent;
* ``MANIFEST.json``: what is in it and where it came from.

``/out/`` is ignored by git, so the device tool can carry the folder (``carry: ["out/gpu-check-bundle"]``).
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lab import engine_build
from lab.gpu_check import build, unit

SOURCE = "llama.cpp-src.tar.xz"
WHEELS = "wheels"
STRACE_ROOT = "strace-root"
UNIT = "llama.service"
SYSCALL_FILTER = "syscall-filter.txt"
MANIFEST = "MANIFEST.json"

# Imported by the probe's parsers and the Ansible modules, missing from a plain CUDA/PyTorch image.
WHEEL_PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "ansible-core")
DEBS = ("strace", "libunwind8")


def download_wheels(dest: Path, python_version: str) -> list[str]:
    """The locked versions of WHEEL_PACKAGES as wheels for CPython ``python_version`` on x86-64 Linux."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEEL_PACKAGES]
    abi = "cp" + python_version.replace(".", "")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "none",
                    "-d", str(dest), *pins], check=True)
    return pins


def unpack_debs(dest: Path) -> list[str]:
    """``apt-get download`` the DEBS and unpack them under ``dest``; returns the .deb names."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-debs-") as tmp:
        subprocess.run(["apt-get", "download", "-q", *DEBS], cwd=tmp, check=True, capture_output=True)
        debs = sorted(Path(tmp).glob("*.deb"))
        for deb in debs:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
        return [deb.name for deb in debs]


def prepare(dest: Path, *, python_version: str = "3.12", gpus: list[dict[str, int]] | None = None) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, object] = {}
    source = build.write_source_tarball(dest / SOURCE)
    manifest["source"] = {"file": SOURCE, "sha256": engine_build.sha256_file(source),
                          "from": f"{engine_build.SDIST_NAME} {engine_build.SDIST_VERSION} "
                                  f"({engine_build.SDIST_SHA256})", "llama.cpp": engine_build.LLAMA_CPP_COMMIT}
    if (dest / WHEELS).exists():
        shutil.rmtree(dest / WHEELS)
    manifest["wheels"] = {"python": python_version, "packages": download_wheels(dest / WHEELS, python_version)}
    if (dest / STRACE_ROOT).exists():
        shutil.rmtree(dest / STRACE_ROOT)
    manifest["strace"] = unpack_debs(dest / STRACE_ROOT)
    gpus = gpus if gpus is not None else [{"index": 0, "minor_number": 0}]
    (dest / UNIT).write_text(unit.render_unit(gpus))
    manifest["unit"] = {"file": UNIT, "gpus": gpus}
    text, where = unit.syscall_groups_text()
    (dest / SYSCALL_FILTER).write_text(f"# {where}\n{text}")
    manifest["syscall_filter"] = where
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest


def strace_command(root: Path) -> tuple[str, str] | None:
    """The bundled strace and the library folder it needs (LD_LIBRARY_PATH), when the bundle has one."""
    binary = root / "usr" / "bin" / "strace"
    if not binary.is_file():
        return None
    return str(binary), str(root / "usr" / "lib" / "x86_64-linux-gnu")
