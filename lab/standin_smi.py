"""A stand-in ``nvidia-smi`` for the lab's systemd target: it prints captured outputs.

The lab has no GPU, yet the live probe (the script, SSH, the parsers) should run for real against a
real Linux box. This installs a small sh script as ``/usr/local/bin/nvidia-smi`` in a target
container that answers each argument form the probe uses with a captured output:

    nvidia-smi --query-gpu=... --format=csv  -> nvidia-smi-query.csv
    nvidia-smi                               -> nvidia-smi.txt
    nvidia-smi topo -m                       -> nvidia-smi-topo.txt
    nvidia-smi nvlink -s                     -> nvidia-smi-nvlink.txt

A form whose capture is missing fails like a broken tool (message on stderr, exit 9), so a machine
captured with the default table only probes as "GPUs from the table". Each call's arguments are
appended to ``CALL_LOG``, so a test can see what the probe asked for.

Test harness and benchmarks only: never install this on a real box.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

STANDIN_PATH = "/usr/local/bin/nvidia-smi"
CAPTURE_DIR = "/usr/local/share/v100box-standin-smi"
CALL_LOG = "/var/log/v100box-standin-smi.calls"

SMI_FILES = ("nvidia-smi-query.csv", "nvidia-smi.txt", "nvidia-smi-topo.txt", "nvidia-smi-nvlink.txt")
"""The captured outputs the stand-in can print, named as in the ``--from-dir`` contract."""


class _Box(Protocol):
    """What the stand-in needs from a target: run a command inside it (see lab.target.Target)."""

    def exec(self, command: str, *, input: str | None = None, timeout: float = 300) -> str: ...


def standin_script(capture_dir: str = CAPTURE_DIR, call_log: str = CALL_LOG) -> str:
    """The sh script installed as nvidia-smi."""
    folder, log = shlex.quote(capture_dir), shlex.quote(call_log)

    def answer(file: str) -> str:
        path = f"{folder}/{file}"
        return (f'if [ -f {path} ]; then cat {path}; '
                f'else echo "stand-in nvidia-smi: no captured {file}" >&2; exit 9; fi')

    return "\n".join([
        "#!/bin/sh",
        "# v100-llm-box lab stand-in: prints captured nvidia-smi outputs (lab.standin_smi).",
        f'printf \'%s\\n\' "$*" >> {log}',
        'case "$*" in',
        f"  --query-gpu=*' --format=csv') {answer('nvidia-smi-query.csv')} ;;",
        f"  '') {answer('nvidia-smi.txt')} ;;",
        f"  'topo -m') {answer('nvidia-smi-topo.txt')} ;;",
        f"  'nvlink -s') {answer('nvidia-smi-nvlink.txt')} ;;",
        '  *) echo "stand-in nvidia-smi: no captured output for: $*" >&2; exit 9 ;;',
        "esac",
        "",
    ])


def captures_from_dir(folder: Path) -> dict[str, str]:
    """The nvidia-smi captures found in a probe fixture folder (the other files are the box's own)."""
    return {name: (folder / name).read_text() for name in SMI_FILES if (folder / name).is_file()}


def install(box: _Box, captures: Mapping[str, str]) -> None:
    """Install the stand-in with these captures, replacing any earlier ones, and clear the call log."""
    unknown = set(captures) - set(SMI_FILES)
    if unknown:
        raise ValueError(f"not nvidia-smi captures: {', '.join(sorted(unknown))} (expected some of {SMI_FILES})")
    folder = shlex.quote(CAPTURE_DIR)
    box.exec(f"rm -rf {folder} && mkdir -p {folder} && : > {shlex.quote(CALL_LOG)}")
    for name, text in captures.items():
        box.exec(f"cat > {folder}/{name}", input=text)
    box.exec(f"cat > {STANDIN_PATH} && chmod 755 {STANDIN_PATH}", input=standin_script())


def calls(box: _Box) -> list[str]:
    """The argument strings the stand-in was called with since :func:`install`, in order."""
    return box.exec(f"cat {shlex.quote(CALL_LOG)}").splitlines()


def uninstall(box: _Box) -> None:
    box.exec(f"rm -rf {STANDIN_PATH} {shlex.quote(CAPTURE_DIR)} {shlex.quote(CALL_LOG)}")
