"""Collect probe outputs from a live box in one round trip, then parse them.

Probing never changes a host: every command is read-only, and a command whose tool is missing
(no nvidia-smi before the driver is installed) simply yields no output.
"""

from __future__ import annotations

import time
from pathlib import Path

from controller.errors import ProbeError
from controller.model.fleet import Box
from controller.model.profile import HardwareProfile
from controller.stages.transports import Transport, open_transport


def collect_linux(transport: Transport, model_dir: str) -> dict[str, str]:
    from controller.stages.probe.commands import linux_probe_script, split_probe_output

    result = transport.run(linux_probe_script(model_dir), timeout=60)
    sections = split_probe_output(result.stdout)
    if not sections:
        raise ProbeError(
            f"{transport.where}: the probe script printed nothing usable (exit {result.rc}): "
            f"{result.stderr.strip()[:200] or 'no error output'}; is /bin/sh available to this user?"
        )
    return sections


def collect_windows(transport: Transport) -> dict[str, str]:
    """nvidia-smi.exe and the CIM query in one PowerShell script (see controller.stages.probe.windows_collect)."""
    from controller.stages.probe.windows_collect import collect

    return collect(transport)


def probe_box(box: Box, transport: Transport | None = None, *, known_hosts: Path | None = None,
              ) -> tuple[HardwareProfile, dict[str, str], float]:
    """Probe a box; returns the profile, the raw outputs (for the record) and the seconds it took.

    ``known_hosts``: the inventory's SSH known_hosts file (see controller.stages.transports.known_hosts).
    """
    from controller.stages.probe.parse import parse_outputs

    started = time.monotonic()
    own = transport is None
    transport = transport or open_transport(box, known_hosts=known_hosts)
    try:
        if box.os == "windows" or box.transport == "winrm":  # WinRM always lands in PowerShell
            outputs = collect_windows(transport)
        else:
            outputs = collect_linux(transport, box.effective_model_dir)
    finally:
        if own:
            transport.close()
    profile = parse_outputs(outputs, model_dir=box.effective_model_dir)
    if not profile.usable:
        raise ProbeError(f"{transport.where}: the probe ran but nothing in its output could be parsed")
    return profile, outputs, time.monotonic() - started
