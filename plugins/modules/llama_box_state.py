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
author: v100-llm-box
"""

EXAMPLES = r"""
- name: Read the units, models, engines and GPUs
  llama_box_state:
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
           fragment: /etc/systemd/system/llama-tiny-llama.service, drop_ins: [], need_reload: false}}
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
"""

import hashlib
import json
import os

from ansible.module_utils.basic import AnsibleModule

UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "UnitFileState", "FragmentPath", "DropInPaths",
                   "NeedDaemonReload")
GPU_QUERY = "index,name,driver_version,temperature.gpu,memory.used,memory.total"
# nvidia-smi's CSV header names (without units) -> the field this module returns
GPU_FIELDS = {"index": "index", "name": "name", "driver_version": "driver_version",
              "temperature.gpu": "temperature_c", "memory.used": "memory_used_mib",
              "memory.total": "memory_total_mib"}
MARKER_SUFFIX = ".verified"  # gguf_download's record of a checked file
MARKER_FIELDS = ("size", "mtime_ns", "inode", "uid")


def parse_show(text, names):
    """``systemctl show`` prints one block per unit, in the order asked, properties as ``Key=value``."""
    blocks = text.strip("\n").split("\n\n")
    units = {}
    for name, block in zip(names, blocks):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        units[name] = {
            "load": props.get("LoadState", ""),
            "active": props.get("ActiveState", ""),
            "sub": props.get("SubState", ""),
            "enabled": props.get("UnitFileState", ""),
            "fragment": props.get("FragmentPath", ""),
            "drop_ins": props.get("DropInPaths", "").split(),
            "need_reload": props.get("NeedDaemonReload", "no") == "yes",
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


def read_gpus(run):
    # Where the driver installs it; run as root, so never looked up on PATH.
    smi = "/usr/bin/nvidia-smi" if os.access("/usr/bin/nvidia-smi", os.X_OK) else None
    if smi is None:
        return [], "nvidia-smi not found"
    rc, out, err = run([smi, "--query-gpu=" + GPU_QUERY, "--format=csv"])
    if rc != 0:
        return [], f"nvidia-smi exited {rc}: " + (err or out).strip()[:300]
    return parse_gpus(out), ""


def main():
    module = AnsibleModule(
        argument_spec=dict(
            units=dict(type="list", elements="str", default=[]),
            files=dict(type="list", elements="str", default=[]),
            links=dict(type="list", elements="str", default=[]),
            checksums=dict(type="list", elements="str", default=[]),
            gpus=dict(type="bool", default=True),
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
    module.exit_json(
        changed=False,
        units=units,
        files={path: read_file(path) for path in params["files"]},
        links={path: read_link(path) for path in params["links"]},
        checksums={path: checksum(path) for path in params["checksums"]},
        gpus=gpus,
        gpu_error=gpu_error,
    )


if __name__ == "__main__":
    main()
