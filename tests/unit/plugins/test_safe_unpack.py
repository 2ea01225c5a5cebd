"""safe_unpack, run as Ansible runs it, on crafted archives: root unpacks a pack without trusting it."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.unit.plugins.loader import run_module


def _run(tmp_path: Path, **args: Any) -> dict[str, Any]:
    proc, result = run_module("safe_unpack", tmp_path, args, timeout=60)
    assert (proc.returncode != 0) == bool(result.get("failed")), proc.stdout + proc.stderr
    return result


def _info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, **extra: Any) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.uname, info.gname = kind, mode, 1000, 1000, "builder", "builder"
    for key, value in extra.items():
        setattr(info, key, value)
    return info


def _tar(path: Path, *entries: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(b"precious\n")
    path.chmod(0o600)
    return path


GOOD = (
    (_info("bin", tarfile.DIRTYPE, 0o777), None),
    (_info("bin/llama-server", mode=0o775), b"#!/bin/sh\necho version\n"),
    (_info("bin/llama-cli", tarfile.LNKTYPE, 0o775, linkname="bin/llama-server"), None),
    (_info("lib/libggml.so.1", mode=0o666), b"ELF"),
    (_info("lib/libggml.so", tarfile.SYMTYPE, 0o777, linkname="libggml.so.1"), None),
    (_info("BUILD-INFO", mode=0o600), b"commit 0c1e570\n"),
)


def test_a_normal_pack_is_unpacked_root_owned_with_sane_modes(tmp_path: Path) -> None:
    dest = tmp_path / "0c1e570.partial"

    result = _run(tmp_path, src=str(_tar(tmp_path / "pack.tar.gz", *GOOD)), dest=str(dest))

    assert (result["changed"], result["files"], result["links"]) == (True, 3, 2)
    modes = {str(path.relative_to(dest)): (path.lstat().st_uid, path.lstat().st_gid, stat.S_IMODE(path.lstat().st_mode))
             for path in [dest, *dest.rglob("*")] if not path.is_symlink()}
    assert modes == {
        ".": (0, 0, 0o755), "bin": (0, 0, 0o755), "lib": (0, 0, 0o755),
        "bin/llama-server": (0, 0, 0o755), "bin/llama-cli": (0, 0, 0o755),
        "lib/libggml.so.1": (0, 0, 0o644), "BUILD-INFO": (0, 0, 0o644),
    }
    assert os.readlink(dest / "lib" / "libggml.so") == "libggml.so.1"
    assert subprocess.run([dest / "bin" / "llama-server"], check=True, capture_output=True, text=True).stdout == "version\n"


def test_strip_components_drops_the_top_folder(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "src.tar.gz", (_info("tiny-llama", tarfile.DIRTYPE, 0o755), None),
                   (_info("tiny-llama/CMakeLists.txt"), b"project(x)\n"))

    _run(tmp_path, src=str(archive), dest=str(tmp_path / "tree"), strip_components=1)

    assert os.listdir(tmp_path / "tree") == ["CMakeLists.txt"]


CRAFTED = {
    "setuid": ([(_info("bin/llama-server", mode=0o4755), b"x")], "setuid or setgid"),
    "setgid": ([(_info("bin/llama-server", mode=0o2755), b"x")], "setuid or setgid"),
    "dotdot": ([(_info("bin/../../victim"), b"owned\n")], "climbs out"),
    "absolute": ([(_info("{victim}"), b"owned\n")], "absolute name"),
    "symlink-etc": ([(_info("etc", tarfile.SYMTYPE, linkname="/etc"), None)], "only relative links"),
    "symlink-up": ([(_info("bin/up", tarfile.SYMTYPE, linkname="../../victim"), None)], "leaves the folder"),
    "through-link": ([(_info("sub", tarfile.DIRTYPE, 0o755), None),
                      (_info("d", tarfile.SYMTYPE, linkname="sub"), None),
                      (_info("d/x"), b"x")], "written through d"),
    "hardlink-out": ([(_info("bin/shadow", tarfile.LNKTYPE, linkname="{victim}"), None)], "absolute name"),
    "hardlink-up": ([(_info("bin/shadow", tarfile.LNKTYPE, linkname="../victim"), None)], "climbs out"),
    "hardlink-unknown": ([(_info("bin/x", tarfile.LNKTYPE, linkname="bin/nothing"), None)], "no file unpacked"),
    "chardev": ([(_info("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1), None)], "device, FIFO"),
    "blockdev": ([(_info("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0), None)], "device, FIFO"),
    "fifo": ([(_info("pipe", tarfile.FIFOTYPE), None)], "device, FIFO"),
    "duplicate": ([(_info("a"), b"1"), (_info("a"), b"2")], "appears twice"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_archive_is_refused_and_leaves_nothing(tmp_path: Path, victim: Path, case: str) -> None:
    entries, reason = CRAFTED[case]
    for info, _ in entries:
        info.name, info.linkname = info.name.format(victim=victim), info.linkname.format(victim=victim)
    dest = tmp_path / "out" / "v1.partial"
    dest.parent.mkdir()

    result = _run(tmp_path, src=str(_tar(tmp_path / "crafted.tar.gz", *entries)), dest=str(dest))

    assert result["failed"] and reason in result["msg"], result["msg"]
    assert result["msg"].startswith("Refusing to unpack") and "\n" not in result["msg"]
    assert not dest.exists() and os.listdir(tmp_path / "out") == []
    assert victim.read_bytes() == b"precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["args.json", "crafted.tar.gz", "out", "victim"]


def _zip(path: Path, *entries: tuple[str, int, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, mode, data in entries:
            info = zipfile.ZipInfo(name)
            info.create_system, info.external_attr = 3, mode << 16
            archive.writestr(info, data)
    return path


def test_zip_packs_get_the_same_rules(tmp_path: Path) -> None:
    good = _zip(tmp_path / "good.zip", ("bin/llama-server", stat.S_IFREG | 0o755, b"x"),
                ("bin/README", stat.S_IFREG | 0o666, b"y"))
    _run(tmp_path, src=str(good), dest=str(tmp_path / "good"))
    assert stat.S_IMODE((tmp_path / "good" / "bin" / "llama-server").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "good" / "bin" / "README").stat().st_mode) == 0o644

    escaping = _zip(tmp_path / "bad.zip", ("bin/etc", stat.S_IFLNK | 0o777, b"/etc"))
    assert "only relative links" in _run(tmp_path, src=str(escaping), dest=str(tmp_path / "bad"))["msg"]
    setuid = _zip(tmp_path / "suid.zip", ("bin/llama-server", stat.S_IFREG | 0o4755, b"x"))
    assert "setuid" in _run(tmp_path, src=str(setuid), dest=str(tmp_path / "suid"))["msg"]
    assert not (tmp_path / "bad").exists() and not (tmp_path / "suid").exists()


def test_a_folder_with_content_is_not_unpacked_into(tmp_path: Path) -> None:
    dest = tmp_path / "tree"
    dest.mkdir()
    (dest / "old").write_text("kept")

    result = _run(tmp_path, src=str(_tar(tmp_path / "pack.tar.gz", *GOOD)), dest=str(dest))

    assert result["failed"] and "new or empty folder" in result["msg"]
    assert os.listdir(dest) == ["old"]


def test_check_mode_reads_the_archive_and_writes_nothing(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "pack.tar.gz", *GOOD)

    result = _run(tmp_path, src=str(archive), dest=str(tmp_path / "tree"), _ansible_check_mode=True)
    refused = _run(tmp_path, src=str(_tar(tmp_path / "bad.tar.gz", *CRAFTED["setuid"][0])),
                   dest=str(tmp_path / "tree"), _ansible_check_mode=True)

    assert (result["changed"], result["files"]) == (True, 3)
    assert refused["failed"] and not (tmp_path / "tree").exists()
