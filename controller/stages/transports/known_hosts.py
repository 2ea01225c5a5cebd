"""SSH host keys: one OpenSSH ``known_hosts`` file per inventory folder (``Inventory.known_hosts_file``), shared by
the probe and Ansible.

The probe (paramiko) records a new box's key on first contact (trust on first use, said out loud) or the
key the fleet file gives as ``host_key``; every later contact, by the probe and by Ansible's ssh
(``StrictHostKeyChecking=yes`` against the same file), refuses a key that changed. Entries are
unhashed OpenSSH lines, ``host`` on port 22 and ``[host]:port`` otherwise, so ``ssh-keygen -R`` and
ssh itself read them.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

from controller.errors import FleetError, TransportError

Notice = Callable[[str], None]


def entry_name(address: str, port: int) -> str:
    """How ssh and paramiko name a host in known_hosts."""
    return address if port == 22 else f"[{address}]:{port}"


def describe(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


def forget_command(name: str, path: Path) -> str:
    return f"ssh-keygen -R '{name}' -f {path}"


def parse_public_key(text: str, what: str) -> paramiko.PKey:
    """An OpenSSH public key line ("ssh-ed25519 AAAA... [comment]") as a paramiko key."""
    parts = text.split()
    if len(parts) < 2:
        raise FleetError(f"{what}: expected an OpenSSH public key such as 'ssh-ed25519 AAAA...' "
                         "(the box's /etc/ssh/ssh_host_ed25519_key.pub)")
    try:
        return paramiko.PKey.from_type_string(parts[0], base64.b64decode(parts[1], validate=True))
    except (binascii.Error, ValueError, paramiko.SSHException) as exc:
        raise FleetError(f"{what}: not a valid {parts[0]} public key ({exc}); copy the line from the box's "
                         "/etc/ssh/ssh_host_ed25519_key.pub") from None


def _matches(entry: HostKeyEntry, name: str) -> bool:
    for pattern in entry.hostnames:
        if pattern.startswith("|1|"):
            salt = pattern.split("|")[2]
            if paramiko.HostKeys.hash_host(name, salt) == pattern:
                return True
        elif pattern == name:
            return True
    return False


def _entries(path: Path) -> list[tuple[int, str, HostKeyEntry | None]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for number, line in enumerate(lines, 1):
        entry = None
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                entry = HostKeyEntry.from_line(line, number)
            except (InvalidHostKey, paramiko.SSHException, ValueError):
                entry = None  # a key type paramiko does not know: kept, never matched
        out.append((number, line, entry))
    return out


def lookup(path: Path, name: str) -> list[tuple[int, paramiko.PKey]]:
    """The keys recorded for ``name``, with their line numbers."""
    return [(number, entry.key) for number, _line, entry in _entries(path)
            if entry is not None and entry.key is not None and _matches(entry, name)]


def _update_alone(path: Path, change: Callable[[list[str]], list[str]]) -> None:
    """Rewrite the file's lines through ``change`` while holding it exclusively (probes of several boxes at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        lines = handle.read().splitlines()
        new = change(lines)
        if new != lines:
            handle.seek(0)
            handle.truncate()
            handle.write("".join(f"{line}\n" for line in new))


def record(path: Path, name: str, key: paramiko.PKey, *, replace: bool = False) -> None:
    """Append ``name``'s key; with ``replace``, first drop every other line for that name."""
    line = f"{name} {key.get_name()} {key.get_base64()}"

    def change(lines: list[str]) -> list[str]:
        kept = []
        for number, text in enumerate(lines, 1):
            try:
                entry = HostKeyEntry.from_line(text, number) if text.strip() and not text.startswith("#") else None
            except (InvalidHostKey, paramiko.SSHException, ValueError):
                entry = None
            if entry is not None and _matches(entry, name) and (replace or entry.key == key):
                continue
            kept.append(text)
        return [*kept, line]

    _update_alone(path, change)


class HostKeyCheck(paramiko.MissingHostKeyPolicy):
    """Decides about the key a box presents on first contact; ``prepare`` loads what is known first.

    ``fleet_key``: the key the fleet file gives (authoritative, written to the file for Ansible too).
    ``path`` None: nothing is recorded (library use without an inventory); the key is still announced.
    """

    def __init__(self, box_name: str, name: str, path: Path | None, fleet_key: paramiko.PKey | None,
                 notice: Notice):
        self.box_name, self.name, self.path, self.fleet_key, self.notice = box_name, name, path, fleet_key, notice

    def prepare(self, client: paramiko.SSHClient) -> None:
        keys = client.get_host_keys()
        keys.clear()
        if self.fleet_key is not None:
            if self.path is not None and [key for _n, key in lookup(self.path, self.name)] != [self.fleet_key]:
                record(self.path, self.name, self.fleet_key, replace=True)
            keys.add(self.name, self.fleet_key.get_name(), self.fleet_key)
        elif self.path is not None:
            for _number, key in lookup(self.path, self.name):
                keys.add(self.name, key.get_name(), key)

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if self.path is None:
            self.notice(f"{self.box_name}: host key {describe(key)} accepted for this run only (no inventory "
                        "folder to record it in)")
            return
        record(self.path, self.name, key)
        self.notice(f"{self.box_name}: new host key {describe(key)} recorded in {self.path}")

    def refusal(self, presented: paramiko.PKey, expected: paramiko.PKey, where: str) -> TransportError:
        """The one-line error for a key that is not the one known for this box."""
        if self.fleet_key is not None:
            return TransportError(
                f"{where}: host key refused: the box presents {describe(presented)} but host_key in the fleet "
                f"file is {describe(expected)}; if the box was reinstalled, put its new key in host_key")
        line = next((number for number, key in lookup(self.path, self.name) if key == expected), None) \
            if self.path is not None else None
        at = f"{self.path} line {line}" if line else str(self.path)
        return TransportError(
            f"{where}: host key refused: the box presents {describe(presented)}, not the {describe(expected)} "
            f"recorded in {at} (someone may be intercepting the connection); if the box was reinstalled, "
            f"accept its new key with: {forget_command(self.name, self.path)}")
