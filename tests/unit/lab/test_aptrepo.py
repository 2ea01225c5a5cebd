"""The stand-in NVIDIA apt repository: real .debs, a consistent index, and packages that behave."""

from __future__ import annotations

import ctypes
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.stages.probe import parse_outputs
from controller.stages.probe.nvidia_smi import QUERY_FIELDS
from lab import aptrepo


def require_tools(*tools: str, why: str) -> None:
    """Skip on a machine without the tools; fail under CI=true, where nothing the suite needs may skip."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if not missing:
        return
    message = f"{' and '.join(missing)} not found: {why} (./scripts/bootstrap.sh installs them on Debian)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; CI must not skip", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module", autouse=True)
def _package_tools() -> None:
    require_tools("dpkg-deb", "cc", why="they build the stand-in packages")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("V100BOX_CACHE", str(cache))
        return aptrepo.build()


def _stanzas(repo: Path) -> list[dict[str, str]]:
    stanzas = []
    for block in (repo / "Packages").read_text().strip().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if not line.startswith(" "):
                key, _, value = line.partition(": ")
                fields[key] = value
        stanzas.append(fields)
    return stanzas


def _extract(repo: Path, name: str, version: str, dest: Path) -> Path:
    deb = repo / f"{name}_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    return dest


def test_index_lists_every_deb_with_matching_checksums(repo: Path) -> None:
    stanzas = _stanzas(repo)
    debs = sorted(path.name for path in repo.glob("*.deb"))
    assert sorted(s["Filename"].removeprefix("./") for s in stanzas) == debs
    for stanza in stanzas:
        data = (repo / stanza["Filename"]).read_bytes()
        assert stanza["SHA256"] == hashlib.sha256(data).hexdigest()
        assert int(stanza["Size"]) == len(data)
    assert gzip.decompress((repo / "Packages.gz").read_bytes()) == (repo / "Packages").read_bytes()
    release = (repo / "Release").read_text()
    for name in ("Packages", "Packages.gz"):
        data = (repo / name).read_bytes()
        assert f" {hashlib.sha256(data).hexdigest()} {len(data)} {name}\n" in release


def test_every_driver_version_has_the_real_package_names(repo: Path) -> None:
    names = {(s["Package"], s["Version"]) for s in _stanzas(repo)}
    for version in aptrepo.DRIVER_VERSIONS:
        for name in ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-kernel-open-dkms", "nvidia-open", "nvidia-smi",
                     "libcuda1", "libnvidia-ml1", "nvidia-persistenced", "nvidia-modprobe"):
            assert (name, version) in names
    assert {v for n, v in names if n == "libnccl2"} == set(aptrepo.NCCL_VERSIONS)
    majors = {int(v.split(".")[0]) for n, v in names if n == "nvidia-driver"}
    assert min(majors) < 570 and max(majors) >= 595  # outside the window on both sides


def test_driver_prefers_the_open_module_unless_the_proprietary_one_is_named(repo: Path) -> None:
    stanza = next(s for s in _stanzas(repo) if s["Package"] == "nvidia-driver" and s["Version"] == "580.95.05-1")
    first, second = stanza["Depends"].split(", ")[0].split(" | ")
    assert first == "nvidia-kernel-open-dkms (= 580.95.05-1)" and second == "nvidia-kernel-dkms (= 580.95.05-1)"
    dkms = next(s for s in _stanzas(repo) if s["Package"] == "nvidia-kernel-dkms" and s["Version"] == "580.95.05-1")
    assert dkms["Conflicts"] == "nvidia-kernel-open-dkms"


def test_standin_nvidia_smi_answers_the_role_query(repo: Path, tmp_path: Path) -> None:
    root = _extract(repo, "nvidia-smi", "580.95.05-1", tmp_path)
    script = (root / "usr/bin/nvidia-smi").read_text()
    # The box reads its fixture from an absolute path; point the copy at the extracted one.
    script = script.replace(f'"/{aptrepo.STANDIN_GPUS}"', repr(str(root / aptrepo.STANDIN_GPUS)))
    (root / "smi.py").write_text(script)

    def smi(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(root / "smi.py"), *args], capture_output=True, text=True,
                              check=False)

    done = smi("--query-gpu=index,pci.bus_id,name,driver_version", "--format=csv,noheader")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "0, 00000000:04:00.0, Tesla V100-PCIE-32GB, 580.95.05",
        "1, 00000000:1B:00.0, Tesla V100-PCIE-32GB, 580.95.05",
    ]
    assert smi("--query-gpu=name", "--format=csv").stdout.splitlines()[0] == "name"
    # The probe's own query, read by the probe's parser: the box probes as two V100s on the new driver.
    probe_query = smi(f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv")
    assert probe_query.returncode == 0, probe_query.stderr
    profile = parse_outputs({"nvidia-smi-query.csv": probe_query.stdout})
    assert [(g.name, g.memory_mib, g.compute_capability, g.pci_bus_id) for g in profile.gpus] == [
        ("Tesla V100-PCIE-32GB", 32768, "7.0", "00000000:04:00.0"),
        ("Tesla V100-PCIE-32GB", 32768, "7.0", "00000000:1B:00.0"),
    ]
    assert profile.driver.version == "580.95.05" and not profile.warnings
    assert smi("--query-gpu=clocks.bogus", "--format=csv").returncode == 2
    # nvidia-smi -q: each card's device minor number (its index here) and UUID, as the probe reads them.
    details = smi("-q")
    assert details.returncode == 0, details.stderr
    profile = parse_outputs({"nvidia-smi-query.csv": probe_query.stdout, "nvidia-smi-q.txt": details.stdout})
    assert [(g.index, g.minor_number) for g in profile.gpus] == [(0, 0), (1, 1)] and not profile.warnings
    assert smi("-pm", "1").stdout.endswith("All done.\n")
    assert smi("--frobnicate").returncode == 2


def test_libnccl_loads_and_reports_its_package_version(repo: Path, tmp_path: Path) -> None:
    for version, code in zip(aptrepo.NCCL_VERSIONS, (22707, 22803)):
        root = _extract(repo, "libnccl2", version.replace(":", "%3a"), tmp_path / version)
        link = root / aptrepo.LIB_DIR / "libnccl.so.2"
        assert link.is_symlink()
        value = ctypes.c_int(0)
        assert ctypes.CDLL(str(link)).ncclGetVersion(ctypes.byref(value)) == 0
        assert value.value == code == aptrepo.nccl_code(version)


def test_persistenced_ships_a_unit(repo: Path, tmp_path: Path) -> None:
    root = _extract(repo, "nvidia-persistenced", "580.95.05-1", tmp_path)
    unit = (root / "lib/systemd/system/nvidia-persistenced.service").read_text()
    assert "ExecStart=/usr/bin/nvidia-persistenced" in unit and "WantedBy=multi-user.target" in unit


def test_apt_resolves_the_repository_and_a_pin_holds_the_branch(repo: Path, tmp_path: Path) -> None:
    require_tools("apt-get", why="it resolves the repository")
    state = tmp_path / "state"
    (state / "lists" / "partial").mkdir(parents=True)
    (tmp_path / "cache" / "archives" / "partial").mkdir(parents=True)
    # An empty system but for python3, which the stand-in nvidia-smi depends on.
    (tmp_path / "status").write_text("Package: python3\nStatus: install ok installed\nVersion: 3.11.2-1+b1\n"
                                     "Architecture: amd64\nMaintainer: lab\nDescription: stand-in\n")
    (tmp_path / "preferences.d").mkdir()
    (tmp_path / "sources.list").write_text(f"deb [trusted=yes] file:{repo} /\n")
    options = [
        f"-oDir::Etc::SourceList={tmp_path / 'sources.list'}", "-oDir::Etc::SourceParts=/nonexistent",
        f"-oDir::Etc::PreferencesParts={tmp_path / 'preferences.d'}", "-oDir::Etc::Preferences=/nonexistent",
        f"-oDir::State={state}", f"-oDir::State::status={tmp_path / 'status'}", f"-oDir::Cache={tmp_path / 'cache'}",
        "-oAPT::Architecture=amd64", "-oAPT::Architectures::=amd64", "-oDebug::NoLocking=1",
    ]
    subprocess.run(["apt-get", *options, "update"], check=True, capture_output=True)

    def installs(*packages: str) -> set[str]:
        out = subprocess.run(["apt-get", *options, "-s", "install", *packages], check=True, capture_output=True,
                             text=True).stdout
        return {" ".join(line.split()[1:3]) for line in out.splitlines() if line.startswith("Inst ")}

    # Unpinned, apt takes the newest branch and the open module: what the role must prevent.
    assert "nvidia-kernel-open-dkms (595.45.04-1" in installs("nvidia-driver")
    (tmp_path / "preferences.d" / "nvidia.pref").write_text(
        "Package: nvidia-driver nvidia-kernel-dkms nvidia-smi libcuda1 libnvidia-ml1\n"
        "Pin: version 580.*\nPin-Priority: 1001\n"
    )
    chosen = installs("nvidia-driver", "nvidia-kernel-dkms")
    assert "nvidia-driver (580.95.05-1" in chosen and "nvidia-kernel-dkms (580.95.05-1" in chosen
    assert not any("open" in line for line in chosen)


def test_build_is_cached_by_its_inputs(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("V100BOX_CACHE", str(repo.parent.parent))
    assert aptrepo.build() == repo  # same inputs: the cached repository, not a rebuild
    key = aptrepo.input_key()
    monkeypatch.setattr(aptrepo, "DRIVER_VERSIONS", aptrepo.DRIVER_VERSIONS[:-1])
    assert aptrepo.input_key() != key


def test_cli_builds_into_a_folder(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("V100BOX_CACHE", str(repo.parent.parent))
    assert aptrepo.main(["build", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "Packages").read_bytes() == (repo / "Packages").read_bytes()
    assert "deb [trusted=yes] http://127.0.0.1:PORT/ /" in capsys.readouterr().out


def test_standin_nvidia_modprobe_makes_the_nodes_the_real_one_makes(repo: Path, tmp_path: Path) -> None:
    """What it would mknod (a stub records the calls: making real nodes needs a privileged container, as in
    tests/integration/test_nvidia_nodes.py), and that it refuses arguments it does not know."""
    root = _extract(repo, "nvidia-modprobe", "580.95.05-1", tmp_path / "root")
    script = root / "usr/bin/nvidia-modprobe"
    assert os.access(script, os.X_OK)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "mknod").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/mknod.calls\n')
    (stubs / "mknod").chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin"}

    def modprobe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", str(script), *args], capture_output=True, text=True, env=env, check=False)

    assert not Path("/dev/nvidiactl").exists(), "this test needs a machine without NVIDIA device nodes"
    done = modprobe("-c=255", "-c=0", "-c", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["/dev/nvidiactl made", "/dev/nvidia0 made", "/dev/nvidia3 made"]
    assert modprobe("-u", "-c=0").returncode == 0
    assert (tmp_path / "mknod.calls").read_text().splitlines() == [
        "-m 666 /dev/nvidiactl c 195 255", "-m 666 /dev/nvidia0 c 195 0", "-m 666 /dev/nvidia3 c 195 3",
        "-m 666 /dev/nvidia-uvm c 60 0", "-m 666 /dev/nvidia-uvm-tools c 60 1"]
    refused = modprobe("-m")
    assert refused.returncode == 1 and "unsupported argument: -m" in refused.stderr
