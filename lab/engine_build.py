"""Build the CPU llama-server from the llama.cpp source vendored in the llama-cpp-python sdist.

The build takes minutes on two cores, so its output is cached outside the clone, keyed by the
sdist's sha256 and the CMake flags. Run as ``python -m lab.engine_build`` to warm the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The llama.cpp commit this sdist vendors; recorded in the engine catalog as the CPU test build.
LLAMA_CPP_COMMIT = "0c1e570"

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
TARGETS = ("llama-server", "llama-bench")


def cache_root() -> Path:
    base = os.environ.get("V100BOX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "v100-llm-box"
    )
    return Path(base)


def build_key() -> str:
    digest = hashlib.sha256()
    digest.update(SDIST_SHA256.encode())
    for flag in CMAKE_FLAGS + TARGETS:
        digest.update(b"\0" + flag.encode())
    return digest.hexdigest()[:16]


def sdist_path() -> Path:
    """Download the pinned sdist once and verify it."""
    folder = cache_root() / "sdist"
    target = folder / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if target.exists() and sha256_file(target) == SDIST_SHA256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"{SDIST_NAME}=={SDIST_VERSION}", "-d", tmp],
            check=True,
        )
        (downloaded,) = Path(tmp).glob("*.tar.gz")
        actual = sha256_file(downloaded)
        if actual != SDIST_SHA256:
            raise RuntimeError(f"{downloaded.name}: sha256 {actual}, expected {SDIST_SHA256}")
        os.replace(downloaded, target)
    return target


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def extract_source(dest: Path) -> Path:
    """Extract only the vendored llama.cpp tree; returns its real path."""
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist_path()) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix) and "/.git" not in m.name]
        archive.extractall(dest, members=members, filter="data")
    return (dest / prefix).resolve()


def build(jobs: int | None = None) -> Path:
    """Return the folder holding the cached llama-server and llama-bench, building them if needed."""
    out = cache_root() / "engines" / f"llama.cpp-{LLAMA_CPP_COMMIT}-cpu-{build_key()}"
    if all((out / name).is_file() for name in TARGETS):
        return out
    from lab.host import cache_lock  # lab.host imports this module

    # The suite's workers (and other sessions) share the cache: one builds, the others wait for its result.
    with cache_lock(out.parent / f".{out.name}.lock"):
        if all((out / name).is_file() for name in TARGETS):
            return out
        _build_into(out, jobs)
    return out


def _build_into(out: Path, jobs: int | None) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        src = extract_source(Path(tmp))
        build_dir = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS], check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 2)],
            check=True,
        )
        staged = Path(tmp) / "out"
        staged.mkdir()
        for name in TARGETS:
            shutil.copy2(build_dir / "bin" / name, staged / name)
        (staged / "BUILD-INFO").write_text(
            f"llama.cpp {LLAMA_CPP_COMMIT} from {SDIST_NAME} {SDIST_VERSION} ({SDIST_SHA256})\n"
            + "\n".join(CMAKE_FLAGS) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)


if __name__ == "__main__":
    print(build())
