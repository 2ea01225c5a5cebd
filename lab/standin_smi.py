"""A stand-in ``nvidia-smi`` for the lab's systemd target: it prints captured outputs.

The lab has no GPU, yet the live probe (the script, SSH, the parsers) should run for real against a
real Linux box. This installs a small sh script as ``/usr/bin/nvidia-smi`` in a target
container that answers each argument form the probe uses with a captured output:

    nvidia-smi --query-gpu=... --format=csv  -> nvidia-smi-query.csv
    nvidia-smi                               -> nvidia-smi.txt
    nvidia-smi -q                            -> nvidia-smi-q.txt
    nvidia-smi topo -m                       -> nvidia-smi-topo.txt
    nvidia-smi nvlink -s                     -> nvidia-smi-nvlink.txt
    nvidia-smi --query-gpu=SAMPLE_QUERY --format=csv,noheader,nounits  -> nvidia-smi-sample.csv
    nvidia-smi --query-gpu=POWER_QUERY --format=csv,noheader,nounits   -> nvidia-smi-power.csv
    nvidia-smi --query-compute-apps=COMPUTE_APPS_QUERY --format=csv,noheader,nounits -> nvidia-smi-compute-apps.csv
    nvidia-smi -pm 1, nvidia-smi -i N -pl W  -> succeed (logged only)

The last forms serve the thermal guard, the power limits (roles/thermal_guard) and the burn-in: a test
rewrites the sample with :func:`set_sample` to set the temperatures the box reports, and the card's power
range with :func:`set_power_range`, and what each process holds on each card (certify compares it with the plan)
with :func:`set_compute_apps`.

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

STANDIN_PATH = "/usr/bin/nvidia-smi"  # where the driver puts it: root services call it by this path
CAPTURE_DIR = "/usr/local/share/v100box-standin-smi"
CALL_LOG = "/var/log/v100box-standin-smi.calls"

SMI_FILES = ("nvidia-smi-query.csv", "nvidia-smi.txt", "nvidia-smi-q.txt", "nvidia-smi-topo.txt",
             "nvidia-smi-nvlink.txt")
"""The captured outputs the stand-in can print, named as in the ``--from-dir`` contract."""

SAMPLE_QUERY = ("index,uuid,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.mem,"
                "clocks_throttle_reasons.active")
"""The fields the thermal guard and the burn-in sample each GPU with (--format=csv,noheader,nounits)."""
POWER_QUERY = "index,power.min_limit,power.max_limit,power.default_limit"
"""The fields a power limit is checked against (--format=csv,noheader,nounits)."""
COMPUTE_APPS_QUERY = "pid,used_memory,gpu_uuid,gpu_bus_id,process_name"
"""What each process holds on each card (plugins/modules/llama_box_state.py, --format=csv,noheader,nounits)."""
SAMPLE_FILE = "nvidia-smi-sample.csv"
POWER_FILE = "nvidia-smi-power.csv"
COMPUTE_APPS_FILE = "nvidia-smi-compute-apps.csv"
READING_FILES = (SAMPLE_FILE, POWER_FILE, COMPUTE_APPS_FILE)
"""Not captures of a machine: the readings a test sets (:func:`set_sample`, :func:`set_power_range`,
:func:`set_compute_apps`)."""
_CSV_FORMAT = "--format=csv,noheader,nounits"


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
        # A sandboxed caller (the thermal guard's unit) cannot write the log: its calls go unlogged, not failed.
        f'{{ printf \'%s\\n\' "$*" >> {log}; }} 2>/dev/null',
        'case "$*" in',
        f"  '--query-gpu={SAMPLE_QUERY} {_CSV_FORMAT}') {answer(SAMPLE_FILE)} ;;",
        f"  '--query-gpu={POWER_QUERY} {_CSV_FORMAT}') {answer(POWER_FILE)} ;;",
        f"  '--query-compute-apps={COMPUTE_APPS_QUERY} {_CSV_FORMAT}') {answer(COMPUTE_APPS_FILE)} ;;",
        "  '-pm 1') echo 'Persistence mode is already Enabled for GPU 00000000:00:00.0.' ;;",
        "  '-i '[0-9]*' -pl '[0-9]*) echo \"Power limit for GPU $2 was set to $4 W (stand-in).\" ;;",
        f"  --query-gpu=*' --format=csv') {answer('nvidia-smi-query.csv')} ;;",
        f"  '') {answer('nvidia-smi.txt')} ;;",
        f"  '-q') {answer('nvidia-smi-q.txt')} ;;",
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
    unknown = set(captures) - set(SMI_FILES) - set(READING_FILES)
    if unknown:
        raise ValueError(f"not nvidia-smi captures: {', '.join(sorted(unknown))} "
                         f"(expected some of {SMI_FILES + READING_FILES})")
    folder = shlex.quote(CAPTURE_DIR)
    box.exec(f"rm -rf {folder} && mkdir -p {folder} && : > {shlex.quote(CALL_LOG)}")
    for name, text in captures.items():
        box.exec(f"cat > {folder}/{name}", input=text)
    box.exec(f"cat > {STANDIN_PATH} && chmod 755 {STANDIN_PATH}", input=standin_script())


def _csv(rows: list[Mapping[str, object]], fields: str) -> str:
    names = fields.split(",")
    unknown = sorted({key for row in rows for key in row} - set(names))
    if unknown:
        raise ValueError(f"not fields of {fields}: {', '.join(unknown)}")
    return "".join(", ".join("[N/A]" if row.get(name) is None else str(row[name]) for name in names) + "\n"
                   for row in rows)


def sample_csv(rows: list[Mapping[str, object]]) -> str:
    """What nvidia-smi prints for SAMPLE_QUERY: one line per GPU, a field left out or None as "[N/A]"."""
    return _csv(rows, SAMPLE_QUERY)


def power_csv(rows: list[Mapping[str, object]]) -> str:
    """What nvidia-smi prints for POWER_QUERY (index, power.min_limit, power.max_limit, power.default_limit)."""
    return _csv(rows, POWER_QUERY)


def _write(box: _Box, name: str, text: str) -> None:
    folder = shlex.quote(CAPTURE_DIR)
    # written beside and renamed: a reader never sees half a file
    box.exec(f"mkdir -p {folder} && cat > {folder}/{name}.new && mv -f {folder}/{name}.new {folder}/{name}",
             input=text)


def compute_apps_csv(rows: list[Mapping[str, object]]) -> str:
    """What nvidia-smi prints for COMPUTE_APPS_QUERY: one line per process and card, nothing when none holds one."""
    return _csv(rows, COMPUTE_APPS_QUERY)


def set_sample(box: _Box, rows: list[Mapping[str, object]]) -> None:
    """Set what the stand-in reports for SAMPLE_QUERY, e.g. ``[{"index": 0, "temperature.gpu": 86}]``."""
    _write(box, SAMPLE_FILE, sample_csv(rows))


def set_power_range(box: _Box, rows: list[Mapping[str, object]]) -> None:
    """Set what the stand-in reports for POWER_QUERY, e.g. ``[{"index": 0, "power.min_limit": 100, ...}]``."""
    _write(box, POWER_FILE, power_csv(rows))


def set_compute_apps(box: _Box, rows: list[Mapping[str, object]]) -> None:
    """Set what the stand-in reports for COMPUTE_APPS_QUERY, e.g.
    ``[{"pid": 4242, "used_memory": 20610, "gpu_uuid": "GPU-...", "gpu_bus_id": "00000000:00:06.0"}]`` (MiB)."""
    _write(box, COMPUTE_APPS_FILE, compute_apps_csv(rows))


def calls(box: _Box) -> list[str]:
    """The argument strings the stand-in was called with since :func:`install`, in order."""
    return box.exec(f"cat {shlex.quote(CALL_LOG)}").splitlines()


def uninstall(box: _Box) -> None:
    box.exec(f"rm -rf {STANDIN_PATH} {shlex.quote(CAPTURE_DIR)} {shlex.quote(CALL_LOG)}")
