#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: llama_box_state
short_description: Read what a llama.cpp box runs, for status and drift (read-only)
description:
  - One call reads, without changing anything, what C(controller status) compares with the plan and the lock
    (roles/llama_verify C(tasks/status.yml)).
  - Each unit's state from one C(systemctl show) (loaded, active, enabled, unit file, drop-ins, whether systemd
    still runs an older copy of the unit file).
  - Each model file's size, mtime, inode and owner beside the C(<file>.verified) marker that C(gguf_download)
    wrote after it checked the file's sha256 at install. A replaced or rewritten file no longer matches its
    marker; no file is hashed, so a status of a box with hundreds of GB of models takes milliseconds.
  - Each engine's C(current) link (which version serves).
  - The GPUs as C(nvidia-smi --query-gpu) reports them (driver, temperature, memory used and total).
  - With O(gpu_processes), what each process holds on each card (C(nvidia-smi --query-compute-apps)); with each
    unit's main PID, C(controller certify) compares what each server holds with its plan's estimate.
  - Linux only (systemd); on Windows status says it cannot read the box.
options:
  units:
    description: Names of the systemd services, without C(.service).
    type: list
    elements: str
    default: []
  files:
    description: Absolute paths of model files.
    type: list
    elements: str
    default: []
  links:
    description: Absolute paths of the engines' C(current) links.
    type: list
    elements: str
    default: []
  checksums:
    description: Absolute paths of small files (units, environment files) whose SHA-1 to return.
    type: list
    elements: str
    default: []
  gpus:
    description: Whether to ask C(nvidia-smi) about the GPUs.
    type: bool
    default: true
  gpu_processes:
    description: Whether to ask C(nvidia-smi) what memory each process holds on each card (one more call).
    type: bool
    default: false
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Read the units, models, engines and GPUs
  v100box.llm.llama_box_state:
    units: [llama-tiny-llama]
    files: [/var/lib/llama/models/tiny-llama-128k-q8_0.gguf]
    links: [/opt/llama/cpu/current]
"""

RETURN = r"""
units:
  description: By unit name (without C(.service)).
  type: dict
  returned: always
  sample: {llama-tiny-llama: {load: loaded, active: active, sub: running, enabled: enabled,
           fragment: /etc/systemd/system/llama-tiny-llama.service, drop_ins: [], need_reload: false,
           main_pid: 4242}}
files:
  description: By path; C(marker) is the C(.verified) record (null when there is none), C(matches) whether
    the file is still the one it describes (same size, mtime, inode and owner).
  type: dict
  returned: always
  sample: {/var/lib/llama/models/m.gguf: {exists: true, size: 127776, mtime_ns: 1700000000000000000, inode: 12,
           uid: 0, marker: {sha256: 568b..., size: 127776}, matches: true}}
links:
  description: By path, where the link points (null when it is missing or not a link).
  type: dict
  returned: always
checksums:
  description: By path, the file's SHA-1 (what C(ansible.builtin.stat) calls its checksum); null when it is missing.
  type: dict
  returned: always
gpus:
  description: One entry per GPU; a field nvidia-smi did not report is null.
  type: list
  elements: dict
  returned: always
  sample: [{index: 0, name: Tesla V100-PCIE-32GB, driver_version: "580.82.07", temperature_c: 41,
            memory_used_mib: 20480, memory_total_mib: 32768}]
gpu_error:
  description: Why there is no GPU list (no nvidia-smi, or it failed); empty when it answered.
  type: str
  returned: always
gpu_processes:
  description: One entry per process per card it holds memory on (empty unless O(gpu_processes)); C(used_mib) is
    null where nvidia-smi cannot say (C([N/A])); C(unit) is the systemd service whose control group holds the
    process (null when the kernel does not say).
  type: list
  elements: dict
  returned: always
  sample: [{pid: 4242, used_mib: 20610, unit: llama-gemma.service, gpu_uuid: GPU-0fa0c0de-1111-2222-3333-444455556666,
            gpu_bus_id: "00000000:00:06.0", process_name: /opt/llama/upstream/current/bin/llama-server}]
gpu_processes_error:
  description: Why there is no process list (not asked, no nvidia-smi, or it failed); empty when it answered.
  type: str
  returned: always
"""

import hashlib
import json
import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.v100box.llm.plugins.module_utils.systemd import show_properties

UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "UnitFileState", "FragmentPath", "DropInPaths",
                   "NeedDaemonReload", "MainPID")
GPU_QUERY = "index,name,driver_version,temperature.gpu,memory.used,memory.total"
# nvidia-smi's CSV header names (without units) -> the field this module returns
GPU_FIELDS = {"index": "index", "name": "name", "driver_version": "driver_version",
              "temperature.gpu": "temperature_c", "memory.used": "memory_used_mib",
              "memory.total": "memory_total_mib"}
# The process's name last: it is a command line that may hold commas (--format=csv,noheader,nounits).
COMPUTE_APPS_QUERY = "pid,used_memory,gpu_uuid,gpu_bus_id,process_name"
NVIDIA_SMI = "/usr/bin/nvidia-smi"  # where the driver installs it; run as root, so never looked up on PATH
MARKER_SUFFIX = ".verified"  # gguf_download's record of a checked file
MARKER_FIELDS = ("size", "mtime_ns", "inode", "uid")


def parse_show(text, names):
    """``systemctl show``'s answer for ``names``, asked in that order: what each unit's properties say."""
    units = {}
    for name, props in zip(names, show_properties(text)):
        units[name] = {
            "load": props.get("LoadState", ""),
            "active": props.get("ActiveState", ""),
            "sub": props.get("SubState", ""),
            "enabled": props.get("UnitFileState", ""),
            "fragment": props.get("FragmentPath", ""),
            "drop_ins": props.get("DropInPaths", "").split(),
            "need_reload": props.get("NeedDaemonReload", "no") == "yes",
            "main_pid": int(props["MainPID"]) if props.get("MainPID", "").isdigit() else 0,  # 0: not running
        }
    return units


def read_units(names, run):
    if not names:
        return {}
    rc, out, err = run(["systemctl", "show", "--property=" + ",".join(UNIT_PROPERTIES)]
                       + [name + ".service" for name in names])
    if rc != 0:
        raise RuntimeError("systemctl show failed: " + (err or out).strip()[:300])
    return parse_show(out, names)


def read_file(path):
    try:
        found = os.lstat(path)
    except OSError:
        return {"exists": False, "marker": None, "matches": False}
    state = {"exists": True, "size": found.st_size, "mtime_ns": found.st_mtime_ns, "inode": found.st_ino,
             "uid": found.st_uid, "marker": None}
    try:
        with open(path + MARKER_SUFFIX, encoding="utf-8") as handle:
            marker = json.load(handle)
        state["marker"] = marker if isinstance(marker, dict) else None
    except (OSError, ValueError):
        pass
    marker = state["marker"] or {}
    state["matches"] = bool(marker) and all(marker.get(field) == state[field] for field in MARKER_FIELDS)
    return state


def read_link(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def checksum(path):
    digest = hashlib.sha1()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 16), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _number(text):
    text = text.strip().split(" ")[0]
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def parse_gpus(text):
    """CSV with a header (``--format=csv``); fields found by name, so any column order or extra column reads."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not lines:
        return []
    header = [column.strip().split(" [")[0] for column in lines[0].split(",")]
    gpus = []
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split(",")]
        row = dict(zip(header, cells))
        gpu = {}
        for column, field in GPU_FIELDS.items():
            value = row.get(column)
            if value is None or value.startswith("[") or value in ("N/A", ""):
                gpu[field] = None
            elif field in ("name", "driver_version"):
                gpu[field] = value
            else:
                gpu[field] = _number(value)
        gpus.append(gpu)
    return gpus


def _smi(run, args, parse):
    """(what ``parse`` reads in nvidia-smi's answer to ``args``, "") or ([], why there is none)."""
    if not os.access(NVIDIA_SMI, os.X_OK):
        return [], "nvidia-smi not found"
    rc, out, err = run([NVIDIA_SMI, *args])
    if rc != 0:
        return [], f"nvidia-smi exited {rc}: " + (err or out).strip()[:300]
    return parse(out), ""


def read_gpus(run):
    return _smi(run, ["--query-gpu=" + GPU_QUERY, "--format=csv"], parse_gpus)


def _present(text):
    return None if text.startswith("[") or text in ("N/A", "") else text


def unit_of(pid, proc="/proc"):
    """The systemd service whose control group holds the process (an on-demand router's model servers are its
    children, in its unit's group), or None when the kernel does not say."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        services = [part for part in line.rpartition(":")[2].split("/") if part.endswith(".service")]
        if services:
            return services[-1]
    return None


def parse_compute_apps(text, unit=unit_of):
    """COMPUTE_APPS_QUERY's lines; no line when no process holds a card. A line that does not start with a PID
    (a message such as "No running processes found") is not a process. ``unit``: a PID's systemd service."""
    processes = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",", 4)]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        used = _number(cells[1]) if _present(cells[1]) else None
        processes.append({"pid": int(cells[0]), "used_mib": None if used is None else int(used),
                          "unit": unit(int(cells[0])),
                          "gpu_uuid": _present(cells[2]), "gpu_bus_id": _present(cells[3]),
                          "process_name": cells[4] if len(cells) > 4 else ""})
    return processes


def read_gpu_processes(run):
    return _smi(run, ["--query-compute-apps=" + COMPUTE_APPS_QUERY, "--format=csv,noheader,nounits"],
                parse_compute_apps)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            units=dict(type="list", elements="str", default=[]),
            files=dict(type="list", elements="str", default=[]),
            links=dict(type="list", elements="str", default=[]),
            checksums=dict(type="list", elements="str", default=[]),
            gpus=dict(type="bool", default=True),
            gpu_processes=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    params = module.params

    def run(argv):
        return module.run_command(argv, environ_update={"LC_ALL": "C"})

    try:
        units = read_units(params["units"], run)
    except RuntimeError as exc:
        module.fail_json(msg=str(exc))
    gpus, gpu_error = read_gpus(run) if params["gpus"] else ([], "not asked")
    processes, processes_error = read_gpu_processes(run) if params["gpu_processes"] else ([], "not asked")
    module.exit_json(
        changed=False,
        units=units,
        files={path: read_file(path) for path in params["files"]},
        links={path: read_link(path) for path in params["links"]},
        checksums={path: checksum(path) for path in params["checksums"]},
        gpus=gpus,
        gpu_error=gpu_error,
        gpu_processes=processes,
        gpu_processes_error=processes_error,
    )


if __name__ == "__main__":
    main()
