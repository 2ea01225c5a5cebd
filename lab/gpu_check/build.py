"""The CUDA llama-server of the CPU test engine's commit, built for this machine's card, cached by key.

Same source (the llama.cpp tree vendored in the pinned llama-cpp-python sdist, ``lab.engine_build``) and the same
CMake flags as the CPU build, with CUDA on and one architecture: the card's compute capability as machine code
only (``<cc>-real``, as the product's packs are built), so the driver compiles nothing at start. A machine that
reaches no package index builds from a slim copy of that tree (:func:`write_source_tarball`, carried in the
prepared bundle) instead of the sdist.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab import engine_build

TARGET = "llama-server"
SOURCE_TOP = "llama.cpp"
# Not needed to build the server (DESIGN.md: the tree without these packs to ~9 MB with xz; tools/ui must stay).
_SLIM_SKIP = ("docs/", "media/", "benches/", ".github/", ".devops/")


def cuda_flags(arch: str, nvcc: str | None = None) -> tuple[str, ...]:
    flags = [flag for flag in engine_build.CMAKE_FLAGS if not flag.startswith("-DGGML_CUDA=")]
    flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}-real"]
    if nvcc:
        flags.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    return tuple(flags)


def arch_from_compute_cap(text: str) -> str:
    """``nvidia-smi --query-gpu=compute_cap --format=csv,noheader``'s first line ("9.0") -> CMake's "90"."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    major, _, minor = first.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"not a compute capability: {first!r}")
    return f"{major}{minor}"


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return os.path.realpath(found)
    for candidate in ("/usr/local/cuda/bin/nvcc", "/usr/bin/nvcc"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def build_key(arch: str, source_sha256: str) -> str:
    digest = hashlib.sha256(source_sha256.encode())
    for flag in cuda_flags(arch) + (TARGET,):
        digest.update(b"\0" + flag.encode())
    return digest.hexdigest()[:16]


def slim_member(name: str) -> bool:
    """Whether a path of the vendored tree (relative to it) goes into the slim source tarball."""
    if "/.git" in f"/{name}" or name.startswith(_SLIM_SKIP):
        return False
    return not (name.startswith("models/") and name.endswith(".gguf"))


def write_source_tarball(dest: Path, sdist_file: Path | None = None) -> Path:
    """The vendored llama.cpp tree of the pinned sdist without docs, vocab GGUFs and media, as ``llama.cpp/...``."""
    prefix = f"llama_cpp_python-{engine_build.SDIST_VERSION}/vendor/llama.cpp/"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist_file or engine_build.sdist_path()) as sdist, tarfile.open(dest, "w:xz", preset=6) as out:
        for member in sdist:
            if not member.name.startswith(prefix):
                continue
            rest = member.name[len(prefix):]
            if not rest or not slim_member(rest):
                continue
            data = sdist.extractfile(member) if member.isfile() else None
            member.name = f"{SOURCE_TOP}/{rest}"
            # a long name travels in a pax header, which would win over the new name when written
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if k != "path"}
            out.addfile(member, data)
    return dest


@dataclass(frozen=True)
class Source:
    """Where the llama.cpp tree comes from: the slim tarball (offline) or the sdist (downloaded once)."""

    tarball: Path | None = None

    def sha256(self) -> str:
        return engine_build.sha256_file(self.tarball) if self.tarball else engine_build.SDIST_SHA256

    def extract(self, dest: Path) -> Path:
        if self.tarball is None:
            return engine_build.extract_source(dest)
        with tarfile.open(self.tarball) as archive:
            archive.extractall(dest, filter="data")
        return (dest / SOURCE_TOP).resolve()


def cached_server(arch: str, source: Source) -> Path:
    return (engine_build.cache_root() / "engines"
            / f"llama.cpp-{engine_build.LLAMA_CPP_COMMIT}-cuda{arch}-{build_key(arch, source.sha256())}")


def start_build(arch: str, source: Source, work: Path, log: Path, jobs: int, nvcc: str) -> tuple[list[list[str]], Path]:
    """Extract the source and return the configure and build commands (run by the caller, in its own process group)."""
    src = source.extract(work / "src")
    build_dir = work / "build"
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *cuda_flags(arch, nvcc)]
    build = ["cmake", "--build", str(build_dir), "--target", TARGET, "-j", str(jobs)]
    log.write_text("")
    return [configure, build], build_dir


def install_build(build_dir: Path, out: Path, arch: str, source: Source) -> Path:
    """Move the built server into the cache folder ``out`` (atomically) and record how it was made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=".stage-"))
    shutil.copy2(build_dir / "bin" / TARGET, staged / TARGET)
    (staged / "BUILD-INFO").write_text(
        f"llama.cpp {engine_build.LLAMA_CPP_COMMIT} from {engine_build.SDIST_NAME} {engine_build.SDIST_VERSION} "
        f"(source sha256 {source.sha256()})\n" + "\n".join(cuda_flags(arch)) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(staged, out)
    return out


def source_gguf_path(source: Source, work: Path) -> Path:
    """Extract (once) only gguf-py from the source, for writing models before or without a build."""
    dest = work / "gguf-src"
    if (dest / "gguf").is_dir():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    if source.tarball is not None:
        prefix = f"{SOURCE_TOP}/gguf-py/"
        with tarfile.open(source.tarball) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            archive.extractall(dest, members=[m for m in members if m.name], filter="data")
    else:
        prefix = f"llama_cpp_python-{engine_build.SDIST_VERSION}/vendor/llama.cpp/gguf-py/"
        with tarfile.open(engine_build.sdist_path()) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            archive.extractall(dest, members=[m for m in members if m.name], filter="data")
    return dest
