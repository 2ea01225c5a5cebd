"""The known_hosts file the probe and Ansible share: OpenSSH's format, as ssh-keygen reads and writes it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko
import pytest

from controller.errors import FleetError
from controller.stages.transports.known_hosts import entry_name, lookup, parse_public_key, record


def keypair(folder: Path, name: str) -> paramiko.PKey:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    return parse_public_key((folder / f"{name}.pub").read_text(), name)


def test_entries_are_named_as_ssh_names_them() -> None:
    assert entry_name("192.0.2.10", 22) == "192.0.2.10"
    assert entry_name("127.0.0.1", 2222) == "[127.0.0.1]:2222"


def test_record_appends_replaces_and_ssh_keygen_finds_the_entries(tmp_path: Path) -> None:
    path = tmp_path / "inventory" / "known_hosts"
    one, two, three = (keypair(tmp_path, name) for name in ("one", "two", "three"))
    record(path, "[127.0.0.1]:2222", one)
    record(path, "[127.0.0.1]:2222", one)  # the same key again: one line
    record(path, "192.0.2.10", two)
    assert [key for _line, key in lookup(path, "[127.0.0.1]:2222")] == [one]
    found = subprocess.run(["ssh-keygen", "-F", "[127.0.0.1]:2222", "-f", str(path)], capture_output=True,
                           text=True, check=True)
    assert one.get_base64() in found.stdout
    record(path, "[127.0.0.1]:2222", three, replace=True)  # what a host_key from the fleet file does
    assert lookup(path, "[127.0.0.1]:2222") == [(2, three)]
    assert lookup(path, "192.0.2.10") == [(1, two)]
    subprocess.run(["ssh-keygen", "-R", "[127.0.0.1]:2222", "-f", str(path)], capture_output=True, check=True)
    assert lookup(path, "[127.0.0.1]:2222") == [] and lookup(path, "192.0.2.10") == [(1, two)]


def test_hashed_entries_written_by_ssh_are_matched(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    key = keypair(tmp_path, "box")
    record(path, "[box.example]:2200", key)
    subprocess.run(["ssh-keygen", "-H", "-f", str(path)], capture_output=True, check=True)
    assert "box.example" not in path.read_text()
    assert lookup(path, "[box.example]:2200") == [(1, key)]
    assert lookup(path, "[box.example]:22") == []


@pytest.mark.parametrize("text", ["", "ssh-ed25519", "ssh-ed25519 not-base64!", "ssh-ed25519 AAAAC3Nz"])
def test_a_malformed_host_key_names_the_box_and_the_file_to_copy(text: str) -> None:
    with pytest.raises(FleetError, match=r"box3: host_key: .*ssh_host_ed25519_key\.pub"):
        parse_public_key(text, "box3: host_key")
