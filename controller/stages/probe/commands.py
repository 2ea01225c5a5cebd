"""The read-only commands a probe runs on a box, one per output file of the ``--from-dir`` contract.

Every command must leave the host untouched and must fail quietly: a box without a driver has no
``nvidia-smi``, and that is a normal state, so a missing tool yields empty output and exit status 0
instead of an error that would abort the single round trip the transports make.

``nvidia-smi`` is looked up on PATH and in ``/usr/lib/wsl/lib`` (where WSL2 puts the host driver's
tools) and bounded by ``timeout``: a wedged GPU can make it hang for minutes. The query asks for
``compute_cap`` first and, because drivers before R510 reject that field and print nothing else,
repeats the query without it.
"""

from __future__ import annotations

import shlex

from controller.stages.probe.nvidia_smi import QUERY_FIELDS
from controller.stages.probe.windows import WINDOWS_CIM_QUERY

_SMI = "timeout 20 nvidia-smi"
_WITH_WSL_PATH = 'PATH="$PATH:/usr/lib/wsl/lib"; '
_QUERY = ",".join(QUERY_FIELDS)
_QUERY_WITHOUT_CAP = ",".join(name for name in QUERY_FIELDS if name != "compute_cap")


def _quiet(command: str) -> str:
    return f"( {command} ) 2>/dev/null || true"


def _smi(arguments: str) -> str:
    return _quiet(f"{_WITH_WSL_PATH}{_SMI}{arguments}")


LINUX_PROBE_COMMANDS: dict[str, str] = {
    # An old driver prints its complaint about compute_cap on stdout: only keep a query that worked.
    "nvidia-smi-query.csv": _quiet(
        f"{_WITH_WSL_PATH}out=$({_SMI} --query-gpu={_QUERY} --format=csv) && printf '%s\\n' \"$out\" "
        f"|| {_SMI} --query-gpu={_QUERY_WITHOUT_CAP} --format=csv"),
    "nvidia-smi.txt": _smi(""),
    # Each card's device minor number (/dev/nvidia<minor>): no --query-gpu field gives it on every driver.
    "nvidia-smi-q.txt": _smi(" -q"),
    "nvidia-smi-topo.txt": _smi(" topo -m"),
    "nvidia-smi-nvlink.txt": _smi(" nvlink -s"),
    "cpuinfo": _quiet("cat /proc/cpuinfo"),
    "meminfo": _quiet("cat /proc/meminfo"),
    "os-release": _quiet("cat /etc/os-release || cat /usr/lib/os-release"),
    "lscpu.txt": _quiet("LC_ALL=C lscpu"),
    # The model folder usually does not exist yet: report the filesystem it will be created on.
    "df.txt": _quiet('d={model_dir}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -P -k "$d"'),
    "proc-version": _quiet("cat /proc/version"),
    "nproc": _quiet("nproc --all"),
    # Cards whose driver is missing or not loaded: nvidia-smi is silent, the PCI bus is not.
    "lspci.txt": _quiet("lspci -Dnn -d 10de:"),
}
"""Output file name -> shell command (POSIX sh). ``df.txt`` has a ``{model_dir}`` placeholder: fill
it with :func:`linux_probe_commands`, which quotes the path."""


def shell_path(path: str) -> str:
    """Quote a path for sh, keeping a leading ``~/`` expandable (``~/models`` -> ``"$HOME"/models``)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"'
    return shlex.quote(path)


def linux_probe_commands(model_dir: str = "/") -> dict[str, str]:
    """:data:`LINUX_PROBE_COMMANDS` with ``df.txt`` pointed at ``model_dir`` (safely quoted)."""
    commands = dict(LINUX_PROBE_COMMANDS)
    commands["df.txt"] = commands["df.txt"].replace("{model_dir}", shell_path(model_dir or "/"))
    return commands


OUTPUT_MARKER = "==> v100-llm-box probe output: "
"""Starts the line that precedes each output in the combined script's stdout."""


def linux_probe_script(model_dir: str = "/") -> str:
    """All Linux probe commands as one sh script, so a transport needs a single round trip.

    Each output is preceded by a line ``OUTPUT_MARKER + name``; :func:`split_probe_output` takes the
    stdout apart again. Each marker is printed after a newline so an output without a final newline
    cannot swallow it; that newline is the line break the split consumes, so outputs come back
    byte for byte.
    """
    parts = ["#!/bin/sh", "LC_ALL=C; export LC_ALL"]
    for name, command in linux_probe_commands(model_dir).items():
        parts.append(f"printf '\\n%s\\n' {shlex.quote(OUTPUT_MARKER + name)}")
        parts.append(command)
    return "\n".join(parts) + "\n"


def split_probe_output(stdout: str) -> dict[str, str]:
    """Outputs by name from the stdout of :func:`linux_probe_script`."""
    outputs: dict[str, str] = {}
    name: str | None = None
    chunk: list[str] = []
    for line in stdout.split("\n"):
        if line.startswith(OUTPUT_MARKER):
            if name is not None:
                outputs[name] = "\n".join(chunk)
            name, chunk = line[len(OUTPUT_MARKER):].strip(), []
        elif name is not None:
            chunk.append(line)
    if name is not None:
        outputs[name] = "\n".join(chunk)
    return outputs


def _ps_native(command: str) -> str:
    """Run a native tool from PowerShell; nothing on stdout when it is missing or fails."""
    return f"try {{ & {command} 2>$null }} catch {{ }}"


_SMI_EXE = "nvidia-smi.exe"

WINDOWS_PROBE_COMMANDS: dict[str, str] = {
    "nvidia-smi-query.csv": _ps_native(f"{_SMI_EXE} --query-gpu={_QUERY} --format=csv"),
    "nvidia-smi.txt": _ps_native(_SMI_EXE),
    "nvidia-smi-topo.txt": _ps_native(f"{_SMI_EXE} topo -m"),
    "nvidia-smi-nvlink.txt": _ps_native(f"{_SMI_EXE} nvlink -s"),
    "windows-cim.json": WINDOWS_CIM_QUERY,
}
"""Output file name -> PowerShell script for a WinRM probe. Windows has no df/cpuinfo files: the CIM
query covers CPU, memory, disks and OS."""
