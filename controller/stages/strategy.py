"""Which Ansible strategy a provision's site.yml run goes under: mitogen's (``mitogen_linear``) or Ansible's own
``linear``.

Mitogen keeps one Python on each box for the whole play, so a task costs the box no interpreter start and module
unpacking (about 385 CPU-ms a module run on the 2-core lab, 23 % of the CPU of the suite's integration part), and the controller
no connection round trip a file it sends. That pays when the roles run in full: a fresh demo box 44.6 -> 25.3 s,
its CPU on the box 23.0 -> 5.2 s. It costs a box its bootstrap (mitogen's own Python sent over SSH) when the play
ends after the converged fast path's one comparison: a converged rerun 7.6 -> 8.9 s, six 13.7 -> 19.3 s
(``benchmarks/fleet_bench.py --boxes 1 6``, ARCHITECTURE.md: The Ansible strategy). So a run goes under mitogen when
one of its boxes is expected to run every role (``--full``, or its rendered inputs are not those of its last run
that ended ok), and under linear when every box is expected to end after the comparison. A wrong guess costs
time only: the same playbook runs either way, and the comparison on the box decides what runs.

Mitogen is used only where the lab proves it: a Linux box reached over SSH as root with a key. A box reached over
WinRM, on the controller itself, as another account that becomes root through sudo, or with a password, and a box
whose ``vars:`` set Ansible's host key checking (mitogen puts that option before the controller's own SSH options,
where the plain ssh connection puts it after them), keeps the whole run on linear.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from controller.model.fleet import Box
from controller.stages.transports.known_hosts import entry_name, lookup

LINEAR = "linear"
MITOGEN = "mitogen_linear"
HOST_KEY_VARS = re.compile(r"^ansible(_ssh)?_host_key_checking$")


@dataclass(frozen=True)
class Choice:
    strategy: str  # LINEAR or MITOGEN
    reason: str  # why, in words, for the run's summary

    def as_dict(self) -> dict[str, str]:
        return {"name": self.strategy, "reason": self.reason}


def not_for_mitogen(box: Box) -> str | None:
    """Why mitogen is not used on this box (None: it may be)."""
    if box.transport != "ssh":
        return f"{box.name} is reached over {box.transport}"
    if box.os != "linux":
        return f"{box.name} runs {box.os}"
    if box.user != "root":
        return f"{box.name} logs in as {box.user}, not root"
    if box.password is not None:
        return f"{box.name} logs in with a password"
    named = sorted(key for key in box.vars if HOST_KEY_VARS.match(key))
    if named:
        return f"{box.name} sets {named[0]} in its vars"
    return None


def inputs_stamp(box: Box, host_vars: Path, known_hosts: Path) -> str | None:
    """What a box's run is expected from: its rendered host variables (the plan, the packs, the models, the
    settings) and the machine it reaches (address, port and the host keys recorded for them, so a box replaced by
    a new machine at the same address, or the demo's box started anew on another port, is expected to run every
    role); None where there are no host variables. The box's own comparison covers the rest (the collection, the
    facts, the secrets)."""
    try:
        digest = hashlib.sha256(host_vars.read_bytes())
    except FileNotFoundError:
        return None
    name = entry_name(box.address, box.effective_port)
    digest.update(name.encode())
    for _line, key in lookup(known_hosts, name) if known_hosts.is_file() else []:
        digest.update(f"\0{key.get_name()} {key.get_base64()}".encode())
    return digest.hexdigest()


def choose(boxes: Iterable[Box], stamps: Mapping[str, str | None], last_ok: Mapping[str, str], *,
           full: bool) -> Choice:
    """The strategy of one run over ``boxes``: ``stamps`` their inputs now, ``last_ok`` those of each box's last
    run that ended ok (``Inventory.last_ok_inputs``)."""
    boxes = list(boxes)
    for box in boxes:
        why = not_for_mitogen(box)
        if why is not None:
            return Choice(LINEAR, why)
    if full:
        return Choice(MITOGEN, "--full runs every role")
    for box in boxes:
        if box.name not in last_ok:
            return Choice(MITOGEN, f"{box.name} has no run that ended ok on record: every role is expected to run")
        if stamps.get(box.name) is None or last_ok[box.name] != stamps[box.name]:
            return Choice(MITOGEN, f"{box.name}'s rendered inputs or recorded host key changed since its last run "
                                   "that ended ok: every role is expected to run")
    return Choice(LINEAR, "every box is expected to match the record of its last full run (one comparison each)")


def environment(strategy: str) -> dict[str, str]:
    """What ansible-playbook needs in its environment to run under ``strategy``."""
    if strategy != MITOGEN:
        return {}
    import ansible_mitogen

    return {"ANSIBLE_STRATEGY_PLUGINS": str(Path(ansible_mitogen.__file__).parent / "plugins" / "strategy"),
            "ANSIBLE_STRATEGY": MITOGEN}
