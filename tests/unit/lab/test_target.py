"""The lab target's host editing (lab.host), image shaping (lab.image) and container bookkeeping (lab.target)
that need no podman."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from lab import host, image, target
from lab.host import LabError
from lab.target import Target


def ulimits_of(path: Path) -> list[str]:
    return tomllib.loads(path.read_text())["containers"]["default_ulimits"]


def test_ulimits_are_written_into_a_missing_file(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    assert host.ensure_default_ulimits(conf) is True
    assert ulimits_of(conf) == ["nofile=20000:20000", "nproc=32768:32768"]
    assert host.ensure_default_ulimits(conf) is False  # second run changes nothing


def test_ulimits_merge_keeps_the_rest_of_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    original = (
        "# operator's notes stay\n"
        "[containers]\n"
        'log_driver = "k8s-file"\n'
        "default_ulimits = [\n"
        '  "core=-1:-1",   # keep core dumps\n'
        '  "nofile=1048576:1048576",\n'
        "]\n"
        "pids_limit = 2048\n"
        "\n"
        "[engine]\n"
        'cgroup_manager = "cgroupfs"\n'
    )
    conf.write_text(original)
    assert host.ensure_default_ulimits(conf) is True
    parsed = tomllib.loads(conf.read_text())
    assert parsed["containers"]["default_ulimits"] == [
        "core=-1:-1", "nofile=20000:20000", "nproc=32768:32768",
    ]
    assert parsed["containers"]["log_driver"] == "k8s-file"
    assert parsed["containers"]["pids_limit"] == 2048
    assert parsed["engine"] == {"cgroup_manager": "cgroupfs"}
    assert conf.read_text().startswith("# operator's notes stay\n")
    assert host.ensure_default_ulimits(conf) is False


def test_ulimits_go_into_an_existing_containers_table(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    conf.write_text('[engine]\nruntime = "crun"\n\n[containers]\nuserns = "host"\n')
    host.ensure_default_ulimits(conf)
    parsed = tomllib.loads(conf.read_text())
    assert parsed["containers"]["userns"] == "host"
    assert parsed["containers"]["default_ulimits"][-2:] == ["nofile=20000:20000", "nproc=32768:32768"]
    assert parsed["engine"]["runtime"] == "crun"


def test_invalid_containers_conf_is_reported_not_overwritten(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    conf.write_text("[containers\nbroken")
    with pytest.raises(LabError, match="not valid TOML"):
        host.ensure_default_ulimits(conf)
    assert conf.read_text() == "[containers\nbroken"


def test_mirror_comes_from_the_hosts_apt_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "deb [arch=amd64 signed-by=/k.gpg] http://vendor.invalid/apt cloud-sdk-bookworm main\n"
    )
    (tmp_path / "sources.list.d/debian.sources").write_text(
        "Types: deb\n# a snapshot comment\nURIs: http://mirror.invalid/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    entries = image.apt_source_entries(tmp_path)
    assert ("http://vendor.invalid/apt", ["cloud-sdk-bookworm"], ["main"]) in entries
    assert ("http://mirror.invalid/debian", ["bookworm", "bookworm-updates"], ["main"]) in entries
    monkeypatch.setattr(image, "apt_source_entries", lambda: entries)
    monkeypatch.delenv(image.MIRROR_ENV, raising=False)
    assert image.debian_mirror() == "http://mirror.invalid/debian"
    monkeypatch.setenv(image.MIRROR_ENV, "http://override.invalid/debian")
    assert image.debian_mirror() == "http://override.invalid/debian"


def test_missing_mirror_names_the_variable_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image, "apt_source_entries", list)
    monkeypatch.delenv(image.MIRROR_ENV, raising=False)
    with pytest.raises(LabError, match=image.MIRROR_ENV):
        image.debian_mirror()


def fake_debootstrap_tree(root: Path) -> None:
    for folder in ("etc/systemd/system/multi-user.target.wants", "etc/systemd/system/getty.target.wants",
                   "etc/systemd/system/timers.target.wants", "etc/ssh/sshd_config.d", "etc/default",
                   "var/lib/dbus", "var/cache/apt/archives"):
        (root / folder).mkdir(parents=True)
    wants = root / "etc/systemd/system"
    (wants / "multi-user.target.wants/ssh.service").symlink_to("/lib/systemd/system/ssh.service")
    (wants / "getty.target.wants/getty@tty1.service").symlink_to("/lib/systemd/system/getty@.service")
    (wants / "timers.target.wants/apt-daily.timer").symlink_to("/lib/systemd/system/apt-daily.timer")
    (root / "etc/machine-id").write_text("e9a3279bd8ed48c1914fdc5f8106a473\n")
    (root / "var/lib/dbus/machine-id").write_text("e9a3279bd8ed48c1914fdc5f8106a473\n")
    (root / "etc/ssh/ssh_host_rsa_key").write_text("baked")
    (root / "var/cache/apt/archives/x.deb").write_text("deb")


def test_configured_rootfs_boots_quiet_and_leaves_sshd_to_the_target(tmp_path: Path) -> None:
    fake_debootstrap_tree(tmp_path)
    image.configure_rootfs(tmp_path)
    system = tmp_path / "etc/systemd/system"
    assert os.readlink(system / "systemd-sysctl.service") == "/dev/null"
    assert os.readlink(system / "getty.target") == "/dev/null"
    assert not (system / "multi-user.target.wants/ssh.service").is_symlink()
    assert not (system / "timers.target.wants/apt-daily.timer").is_symlink()
    assert (tmp_path / "etc/machine-id").read_text() == ""
    assert not (tmp_path / "var/lib/dbus/machine-id").exists()
    assert not (tmp_path / "etc/ssh/ssh_host_rsa_key").exists()
    assert not (tmp_path / "var/cache/apt/archives/x.deb").exists()
    sshd = (tmp_path / "etc/ssh/sshd_config.d/00-v100box.conf").read_text()
    assert "PasswordAuthentication no" in sshd and "PermitRootLogin prohibit-password" in sshd


def test_image_key_follows_the_package_list(monkeypatch: pytest.MonkeyPatch) -> None:
    before = image.image_key()
    monkeypatch.setattr(image, "PACKAGES", (*image.PACKAGES, "strace"))
    assert image.image_key() != before


def test_injected_files_authorize_the_key_and_pin_the_port() -> None:
    one = Target(name="t", ssh_port=40123, key_path=None, image="img")
    with tarfile.open(fileobj=io.BytesIO(one._injected_files("ssh-ed25519 AAAA test\n"))) as archive:
        keys = archive.extractfile("root/.ssh/authorized_keys")
        listen = archive.extractfile("etc/ssh/sshd_config.d/10-v100box-listen.conf")
        assert keys is not None and keys.read() == b"ssh-ed25519 AAAA test\n"
        assert archive.getmember("root/.ssh/authorized_keys").mode == 0o600
        assert listen is not None and listen.read() == b"ListenAddress 127.0.0.1:40123\n"
        wants = archive.getmember("etc/systemd/system/multi-user.target.wants/ssh.service")
        assert wants.issym() and wants.linkname == "/lib/systemd/system/ssh.service"


def test_owner_token_is_alive_only_while_its_process_lives() -> None:
    assert target.owner_alive(target.owner_token())
    assert target.owner_alive(target.MANUAL_OWNER)
    child = subprocess.Popen(["sleep", "30"])
    token = target.owner_token(child.pid)
    assert target.owner_alive(token)
    child.kill()
    child.wait()
    assert not target.owner_alive(token)
    assert not target.owner_alive("garbage")


def test_missing_podman_names_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(host.LabUnavailable, match="apt-get install podman crun netavark debootstrap"):
        host.require_tools("podman")
