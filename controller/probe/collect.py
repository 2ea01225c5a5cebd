"""Collect probe outputs from a live box in one round trip, then parse them.

Probing never changes a host: every command is read-only, and a command whose tool is missing
(no nvidia-smi before the driver is installed) simply yields no output.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Mapping

from controller.errors import ProbeError
from controller.fleet import Box
from controller.profile import HardwareProfile
from controller.transports import Transport, open_transport

_MARKER = "::v100box-probe::"
_MARKER_LINE = re.compile(rf"^{re.escape(_MARKER)}(\S+)\r?$", re.MULTILINE)


def linux_script(commands: Mapping[str, str], model_dir: str) -> str:
    """One POSIX shell script that prints each command's output after a marker line naming it."""
    parts = []
    for name, command in commands.items():
        filled = command.replace("{model_dir}", shlex.quote(model_dir))
        parts.append(f"echo '{_MARKER}{name}'; ( {filled} ) 2>/dev/null")
    return "LC_ALL=C; export LC_ALL\n" + "\n".join(parts) + "\nexit 0\n"


def split_sections(stdout: str) -> dict[str, str]:
    """Inverse of the script: {name: output} for every marker seen."""
    sections: dict[str, str] = {}
    matches = list(_MARKER_LINE.finditer(stdout))
    for match, following in zip(matches, matches[1:] + [None]):
        end = following.start() if following else len(stdout)
        sections[match.group(1)] = stdout[match.end() + 1 : end]
    return sections


def collect_linux(transport: Transport, model_dir: str) -> dict[str, str]:
    from controller.probe.parse import LINUX_PROBE_COMMANDS

    result = transport.run(linux_script(LINUX_PROBE_COMMANDS, model_dir), timeout=60)
    sections = split_sections(result.stdout)
    if not sections:
        raise ProbeError(
            f"{transport.where}: the probe script printed nothing usable (exit {result.rc}): "
            f"{result.stderr.strip()[:200] or 'no error output'}; is /bin/sh available to this user?"
        )
    return sections


def collect_windows(transport: Transport) -> dict[str, str]:
    from controller.probe.windows_collect import collect

    return collect(transport)


def probe_box(box: Box, transport: Transport | None = None) -> tuple[HardwareProfile, dict[str, str], float]:
    """Probe a box; returns the profile, the raw outputs (for the record) and the seconds it took."""
    from controller.probe.parse import parse_outputs

    started = time.monotonic()
    own = transport is None
    transport = transport or open_transport(box)
    try:
        if box.os == "windows":
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
