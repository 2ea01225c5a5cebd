"""The llama_service unit the trace is checked against: rendered from the role's template, read back as a policy.

The unit is rendered by Ansible's own template engine (``ansible-playbook`` on localhost, as
tests/unit/test_llama_service_unit.py does), for one instance on the cards the check sees. A machine without
Ansible (the offline GPU machine) takes a unit rendered beforehand (``python -m lab.gpu_check prepare``).

``SystemCallFilter=`` names groups (``@system-service``) that only systemd knows: they are resolved from the
output of ``systemd-analyze syscall-filter`` (all groups, nested ones included), taken from the machine when it
has systemd-analyze, else from the copy recorded beside the prepared unit.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lab import localplay


class RenderError(RuntimeError):
    """ansible-playbook could not render the unit; the message carries its output."""


def render_unit(gpus: Sequence[Mapping[str, object]], *, nccl: bool = False, timeout: float = 120) -> str:
    """The unit llama_service writes for one loopback instance on ``gpus`` (dicts with ``index``, ``minor_number``)."""
    from controller.model import rules

    if localplay.ansible_playbook() is None:
        raise RenderError("ansible-playbook is not installed here: render the unit where it is "
                          "(python -m lab.gpu_check prepare) and pass it with --unit")
    env_vars = {"CUDA_VISIBLE_DEVICES": ",".join(str(g["index"]) for g in gpus)} if gpus else {}
    if nccl:
        env_vars["GGML_CUDA_ALLREDUCE"] = "nccl"
    instance = {"name": "llama-gpu-check", "model": "tiny", "engine": "upstream", "port": 8011,
                "args": ["--model", "/var/lib/llama/models/tiny.gguf", "--port", "8011"], "env": env_vars}
    with tempfile.TemporaryDirectory(prefix="gpu-check-unit-") as tmp:
        out = Path(tmp) / "llama.service"
        task = localplay.template(localplay.ROLES / "llama_service" / "templates" / "llama.service.j2", out,
                                  name="Render the instance's unit", loop="{{ llama_service_instances }}")
        try:
            localplay.run_play("llama_service", [task], {
                "llama_service_instances": [instance],
                "llama_service_bind": "127.0.0.1",
                "llama_service_api_key": "0123456789abcdef0123",
                "nvidia_driver_gpus": [dict(g) for g in gpus],
                "gguf_model_dir": rules.DEFAULT_MODEL_DIR["linux"],
                "llama_service_template_dir": rules.TEMPLATE_DIR["linux"],
            }, Path(tmp), timeout=timeout)
        except localplay.PlayError as exc:
            raise RenderError(str(exc)) from exc
        if not out.is_file():
            raise RenderError(f"ansible-playbook wrote no {out.name}")
        return out.read_text()


@dataclass
class UnitPolicy:
    """What a unit's [Service] section says about system calls, devices, sockets, memory and /proc."""

    syscall_filter: list[str] = field(default_factory=list)  # each entry in order, "~" kept on deny entries
    device_policy: str | None = None
    device_allow: list[tuple[str, str]] = field(default_factory=list)  # (path, access)
    address_families: list[str] = field(default_factory=list)  # "~" first for a deny list
    memory_deny_write_execute: bool = False
    proc_subset: str | None = None
    protect_kernel_tunables: bool = False


# Directives that add to a list on each assignment; an empty assignment resets the list.
_LIST_DIRECTIVES = {"SystemCallFilter": "syscall_filter", "DeviceAllow": "device_allow",
                    "RestrictAddressFamilies": "address_families"}


def _bool(value: str) -> bool:
    return value.strip().lower() in ("yes", "true", "1", "on")


def parse_unit(text: str) -> UnitPolicy:
    """The directives the trace is checked against; repeated list directives add up, an empty one resets."""
    policy = UnitPolicy()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if key in _LIST_DIRECTIVES and not value:
            getattr(policy, _LIST_DIRECTIVES[key]).clear()
        elif key == "SystemCallFilter":
            negate = value.startswith("~")
            policy.syscall_filter.append(("~" if negate else "") + " ".join(value.lstrip("~").split()))
        elif key == "DevicePolicy":
            policy.device_policy = value
        elif key == "DeviceAllow":
            path, _, access = value.partition(" ")
            policy.device_allow.append((path, access.strip() or "rwm"))
        elif key == "RestrictAddressFamilies":
            families = value.lstrip("~").split()
            if value.startswith("~"):
                policy.address_families = ["~", *families]
            else:
                policy.address_families += families
        elif key == "MemoryDenyWriteExecute":
            policy.memory_deny_write_execute = _bool(value)
        elif key == "ProcSubset":
            policy.proc_subset = value
        elif key == "ProtectKernelTunables":
            policy.protect_kernel_tunables = _bool(value)
    return policy


# ---- systemd's system call groups -----------------------------------------------------------------------------

def read_syscall_groups(text: str) -> dict[str, list[str]]:
    """``systemd-analyze syscall-filter`` (no argument: every group) -> group name -> members (names or @groups)."""
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.split()[0], [])
        elif not line.strip() or not line.startswith((" ", "\t")):
            current = None  # the closing list of calls in no group, or a blank between groups
        elif current is not None:
            item = line.strip()
            if item and not item.startswith("#"):
                current.append(item.split()[0])
    return groups


def expand_group(name: str, groups: Mapping[str, Sequence[str]], _seen: frozenset[str] = frozenset()) -> set[str]:
    """The system calls of a group, nested groups expanded; a plain name is itself."""
    if not name.startswith("@"):
        return {name}
    if name not in groups:
        raise KeyError(f"systemd knows no system call group {name}")
    calls: set[str] = set()
    for member in groups[name]:
        if member not in _seen:
            calls |= expand_group(member, groups, _seen | {name})
    return calls


@dataclass(frozen=True)
class SyscallPolicy:
    """An allow list (every call not in ``calls`` is refused) or a deny list (only ``calls`` are refused)."""

    allow_list: bool
    calls: frozenset[str]

    def allowed(self, call: str) -> bool:
        return (call in self.calls) == self.allow_list


def resolve_filter(entries: Sequence[str], groups: Mapping[str, Sequence[str]]) -> SyscallPolicy | None:
    """systemd's rule: the first entry decides allow or deny list; later entries of the other kind take away."""
    if not entries:
        return None
    allow_list = not entries[0].startswith("~")
    calls: set[str] = set()
    for entry in entries:
        negate = entry.startswith("~")
        named: set[str] = set()
        for item in entry.lstrip("~").split():
            named |= expand_group(item.split(":")[0], groups)  # "name:errno" keeps the name
        if negate != (not allow_list):
            calls -= named
        else:
            calls |= named
    return SyscallPolicy(allow_list, frozenset(calls))


def syscall_groups_text(recorded: Path | None = None) -> tuple[str, str]:
    """``systemd-analyze syscall-filter``'s output and where it came from: this machine, else the recorded copy."""
    analyze = shutil.which("systemd-analyze")
    if analyze:
        done = subprocess.run([analyze, "syscall-filter", "--no-pager"], capture_output=True, text=True,
                              timeout=60, check=False)
        if done.returncode == 0 and done.stdout.strip():
            version = subprocess.run([analyze, "--version"], capture_output=True, text=True, check=False)
            first = (version.stdout.splitlines() or ["systemd-analyze"])[0]
            return done.stdout, f"systemd-analyze on this machine ({first})"
    if recorded is not None and recorded.is_file():
        return recorded.read_text(), f"recorded {recorded.name}"
    raise FileNotFoundError("systemd-analyze is not installed and no recorded syscall-filter output was given")
