"""Probe a box: the read-only commands to run on it, and the parsers that turn their output into a
:class:`~controller.model.profile.HardwareProfile`.

Transports (SSH, WinRM) live in :mod:`controller.stages.probe.collect`; everything here is pure text in,
profile out, so it is tested on captured outputs without any box.
"""

from controller.stages.probe.commands import (
    LINUX_PROBE_COMMANDS,
    OUTPUT_MARKER,
    WINDOWS_PROBE_COMMANDS,
    linux_probe_commands,
    linux_probe_script,
    shell_path,
    split_probe_output,
)
from controller.stages.probe.groups import group_names
from controller.stages.probe.parse import PROBE_FILES, parse_outputs, read_dir
from controller.stages.probe.windows import WINDOWS_CIM_QUERY

__all__ = [
    "LINUX_PROBE_COMMANDS",
    "OUTPUT_MARKER",
    "PROBE_FILES",
    "WINDOWS_CIM_QUERY",
    "WINDOWS_PROBE_COMMANDS",
    "group_names",
    "linux_probe_commands",
    "linux_probe_script",
    "parse_outputs",
    "read_dir",
    "shell_path",
    "split_probe_output",
]
