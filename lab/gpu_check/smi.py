"""Every nvidia-smi query the product makes, asked of this machine's driver and read by the product's own parsers.

The queries are taken from where the product makes them, never copied: the probe's script
(``controller.stages.probe.commands``), the thermal guard's script (``roles/thermal_guard/files/thermal_guard.py``),
the burn-in and status modules (``plugins/modules/llama_burn_in.py``, ``llama_box_state.py``) and the roles'
own variables (``nvidia_driver``'s GPU list, ``thermal_guard``'s power range preflight). Two users asking the same
thing share one run. :func:`check_outputs` is pure: the tests feed it the outputs recorded on driver 580.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
GUARD_SCRIPT = ROOT / "ansible_collections/v100box/llm/roles" / "thermal_guard" / "files" / "thermal_guard.py"
MODULES = ROOT / "ansible_collections/v100box/llm/plugins" / "modules"
PROBE_FOLDER = "probe"
DEV_NODES = "dev-nodes.txt"
DEV_NODES_COMMAND = "ls -la /dev/nvidia*"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _loaded(name: str, path: Path) -> tuple[ModuleType | None, str | None]:
    try:
        return _load(name, path), None
    except ImportError as exc:  # the Ansible modules need ansible-core's module_utils
        return None, f"{path.relative_to(ROOT)} cannot be imported here ({exc})"


def _role_var(role: str, name: str) -> Any:
    return yaml.safe_load((ROOT / "ansible_collections/v100box/llm/roles" / role / "vars" / "main.yml").read_text())[name]


@dataclass
class Query:
    """One nvidia-smi call: the file its answer is kept in, its arguments and who in the product asks it."""

    file: str
    args: tuple[str, ...]
    kind: str  # which reader reads it: the file name it has when no two users drift apart
    users: list[str] = field(default_factory=list)


@dataclass
class Parsers:
    """The product's parsers for the queries, loaded from their files; ``missing`` says which could not load."""

    guard: ModuleType | None = None
    burn_in: ModuleType | None = None
    box_state: ModuleType | None = None
    missing: list[str] = field(default_factory=list)


def load_parsers() -> Parsers:
    parsers = Parsers()
    parsers.guard, problem = _loaded("gpu_check_thermal_guard", GUARD_SCRIPT)
    parsers.missing += [problem] if problem else []
    parsers.burn_in, problem = _loaded("gpu_check_llama_burn_in", MODULES / "llama_burn_in.py")
    parsers.missing += [problem] if problem else []
    parsers.box_state, problem = _loaded("gpu_check_llama_box_state", MODULES / "llama_box_state.py")
    parsers.missing += [problem] if problem else []
    return parsers


def product_queries(parsers: Parsers) -> list[Query]:
    """The product's --query-gpu calls (the probe's run as its whole script, see :func:`run_probe`)."""
    asked: list[tuple[str, tuple[str, ...], str]] = []
    if parsers.guard is not None:
        g = parsers.guard
        asked.append(("guard-sample.csv", (f"--query-gpu={g.SAMPLE_QUERY}", g.CSV_FORMAT), "thermal guard sample"))
        asked.append(("guard-power.csv", (f"--query-gpu={g.POWER_QUERY}", g.CSV_FORMAT), "power limit (thermal guard)"))
    if parsers.burn_in is not None:
        asked.append(("guard-sample.csv", (f"--query-gpu={parsers.burn_in.SAMPLE_QUERY}", "--format=csv,noheader,nounits"),
                      "burn-in sample"))
    asked.append(("guard-power.csv", (f"--query-gpu={_role_var('thermal_guard', '_thermal_guard_power_query')}",
                                      "--format=csv,noheader,nounits"), "thermal_guard preflight"))
    if parsers.box_state is not None:
        asked.append(("box-state.csv", (f"--query-gpu={parsers.box_state.GPU_QUERY}", "--format=csv"), "status"))
    asked.append(("driver-gpus.csv", tuple(_role_var("nvidia_driver", "_nvidia_driver_smi_query")),
                  "nvidia_driver verify"))
    queries: dict[tuple[str, ...], Query] = {}
    for file, args, user in asked:
        query = queries.get(args)
        if query is None:
            # the same file name for different arguments means the two users drifted apart: keep both
            taken = {q.file for q in queries.values()}
            name = file if file not in taken else file.replace(".csv", f"-{len(queries)}.csv")
            query = queries[args] = Query(name, args, file)
        query.users.append(user)
    return list(queries.values())


# ---- reading the answers ----------------------------------------------------------------------------------------

@dataclass
class Answer:
    """What one query (or the probe) printed, what the product's parsers made of it, and what went wrong."""

    file: str
    command: str
    users: list[str]
    rc: int | None = None
    parsed: str = ""
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("fail" if self.problems else "pass")

    def line(self) -> str:
        what = self.skipped or ("; ".join(self.problems) if self.problems else self.parsed)
        return f"{self.status.upper():<4} {self.file} ({', '.join(self.users)}): {what}"


def _note_gaps(answer: Answer, rows: Sequence[tuple[str, Mapping[str, Any]]], nothing: str, *,
               keys: Sequence[str] | None = None, what: str = "") -> None:
    """A problem when a parser read no row (``nothing``), and one for each row that lacks a value (of ``keys``, by
    default of all it has): ``<row> has no <names><what>``."""
    if not rows:
        answer.problems.append(nothing)
    for name, values in rows:
        empty = [key for key in (keys or values) if values.get(key) is None]
        if empty:
            answer.problems.append(f"{name} has no {', '.join(empty)}{what}")


def _read_guard_sample(parsers: Parsers, text: str, answer: Answer) -> None:
    found = []
    if parsers.guard is not None:
        try:
            readings = parsers.guard.parse_sample(text)
        except ValueError as exc:
            answer.problems.append(f"thermal guard: {exc}")
            readings = []
        if not readings and not answer.problems:
            answer.problems.append("thermal guard: no GPU in the sample")
        for reading in readings:
            if reading.temp_c is None:
                answer.problems.append(f"thermal guard: GPU {reading.index} has no core temperature")
        found.append(f"guard read {len(readings)} GPU(s): " + ", ".join(
            f"{r.index}: {r.temp_c}/{r.memory_temp_c} C" for r in readings))
    if parsers.burn_in is not None:
        gpus = parsers.burn_in.parse_sample(text)
        _note_gaps(answer, [(f"burn-in: GPU {gpu['index']}", gpu) for gpu in gpus], "burn-in: no GPU in the sample",
                   keys=("temp_c", "power_w", "power_limit_w", "sm_clock_mhz", "mem_clock_mhz"))
        found.append(f"burn-in read {len(gpus)}")
    answer.parsed = "; ".join(found)


def _read_guard_power(parsers: Parsers, text: str, answer: Answer) -> None:
    if parsers.guard is None:
        answer.skipped = "the thermal guard script did not load"
        return
    ranges = parsers.guard.parse_power(text)
    _note_gaps(answer, [(f"GPU {index}", values) for index, values in ranges.items()], "no power range read",
               what=" power limit")
    answer.parsed = ", ".join(f"GPU {i}: {v['min']:g}-{v['max']:g} W (default {v['default']:g})"
                              for i, v in ranges.items() if None not in v.values())


def _read_box_state(parsers: Parsers, text: str, answer: Answer) -> None:
    if parsers.box_state is None:
        answer.skipped = "llama_box_state did not load"
        return
    gpus = parsers.box_state.parse_gpus(text)
    _note_gaps(answer, [(f"GPU {gpu.get('index')}", gpu) for gpu in gpus], "no GPU read")
    answer.parsed = ", ".join(f"GPU {g['index']}: {g['name']}, driver {g['driver_version']}, "
                              f"{g['memory_used_mib']}/{g['memory_total_mib']} MiB" for g in gpus)


def _read_driver_gpus(_parsers: Parsers, text: str, answer: Answer) -> None:
    # roles/nvidia_driver/tasks/linux-verify.yml zips each line's comma-separated cells with these four names
    rows = [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]
    if not rows:
        answer.problems.append("no GPU listed")
    for row in rows:
        if len(row) != 4 or not row[0].isdigit():
            answer.problems.append(f"not index, pci.bus_id, name, driver_version: {', '.join(row)[:100]!r}")
    answer.parsed = ", ".join(f"GPU {r[0]} at {r[1]}" for r in rows if len(r) == 4)


READERS: dict[str, Callable[[Parsers, str, Answer], None]] = {
    "guard-sample.csv": _read_guard_sample,
    "guard-power.csv": _read_guard_power,
    "box-state.csv": _read_box_state,
    "driver-gpus.csv": _read_driver_gpus,
}


def read_probe(sections: Mapping[str, str]) -> Answer:
    """The probe's outputs through ``controller.stages.probe.parse.parse_outputs``: the profile, and what it could not read."""
    from controller.stages.probe.parse import parse_outputs

    answer = Answer(PROBE_FOLDER, "the probe's script (controller.stages.probe.commands.linux_probe_script)", ["probe"])
    profile = parse_outputs(dict(sections), model_dir="/")
    answer.problems += [f"warning: {w}" for w in profile.warnings]
    if not profile.gpus:
        answer.problems.append("the profile has no GPU")
    for gpu in profile.gpus:
        empty = [name for name in ("compute_capability", "memory_mib", "pci_bus_id", "uuid", "minor_number")
                 if getattr(gpu, name, None) is None]
        if empty:
            answer.problems.append(f"GPU {gpu.index} has no {', '.join(empty)}")
    if profile.driver.version is None:
        answer.problems.append("no driver version")
    answer.parsed = "; ".join(
        [f"GPU {g.index}: {g.name}, {g.memory_mib} MiB, compute {g.compute_capability}, minor {g.minor_number}"
         for g in profile.gpus]
        + [f"driver {profile.driver.version} (CUDA {profile.driver.cuda_version})"])
    return answer


def check_outputs(parsers: Parsers, queries: list[Query], outputs: Mapping[str, str],
                  probe: Mapping[str, str] | None, rcs: Mapping[str, int] | None = None) -> list[Answer]:
    """Each query's answer read by the product's parsers; ``outputs`` by file name, ``probe`` the probe's outputs."""
    answers = []
    for query in queries:
        answer = Answer(query.file, "nvidia-smi " + " ".join(query.args), list(query.users),
                        rc=(rcs or {}).get(query.file))
        text = outputs.get(query.file)
        if text is None:
            answer.skipped = "not run"
        elif answer.rc not in (None, 0):
            answer.problems.append(f"nvidia-smi exited {answer.rc}: {text.strip()[:200]}")
        else:
            READERS[query.kind](parsers, text, answer)
        answers.append(answer)
    if probe is not None:
        try:
            answers.append(read_probe(probe))
        except ImportError as exc:  # the profile is a pydantic model
            answers.append(Answer(PROBE_FOLDER, "the probe's script", ["probe"],
                                  skipped=f"the probe's parsers cannot be imported here ({exc})"))
    for problem in parsers.missing:
        answers.append(Answer("parsers", "import", ["gpu check"], skipped=problem))
    return answers


# ---- asking the driver ----------------------------------------------------------------------------------------

def find_smi(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit
    return shutil.which("nvidia-smi") or ("/usr/bin/nvidia-smi" if os.access("/usr/bin/nvidia-smi", os.X_OK) else None)


def _env_with(smi: str) -> tuple[dict[str, str], tempfile.TemporaryDirectory[str]]:
    """PATH with ``smi`` first, under the name nvidia-smi, so the probe's script finds the one asked for."""
    folder = tempfile.TemporaryDirectory(prefix="gpu-check-smi-")
    os.symlink(os.path.abspath(smi), os.path.join(folder.name, "nvidia-smi"))
    return {**os.environ, "PATH": folder.name + os.pathsep + os.environ.get("PATH", ""), "LC_ALL": "C"}, folder


def run_queries(smi: str, queries: list[Query], out: Path, *, timeout: float = 30) -> tuple[dict[str, str], dict[str, int]]:
    """Run each query; keep each answer (stdout, and stderr when it failed) as ``out/<file>``."""
    out.mkdir(parents=True, exist_ok=True)
    outputs, rcs = {}, {}
    for query in queries:
        try:
            done = subprocess.run([smi, *query.args], capture_output=True, text=True, timeout=timeout, check=False,
                                  env={**os.environ, "LC_ALL": "C"})
            text, rc = done.stdout + (done.stderr if done.returncode else ""), done.returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            text, rc = f"{exc}\n", 127
        outputs[query.file], rcs[query.file] = text, rc
        (out / query.file).write_text(text)
    return outputs, rcs


def run_probe(smi: str, out: Path, *, timeout: float = 120) -> dict[str, str]:
    """The probe's own script, run here as it runs on a box; each output kept as ``out/<name>``."""
    from controller.stages.probe.commands import linux_probe_script, split_probe_output

    env, folder = _env_with(smi)
    with folder:
        done = subprocess.run(["sh", "-c", linux_probe_script("/")], capture_output=True, text=True, env=env,
                              timeout=timeout, check=False)
    sections = split_probe_output(done.stdout)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sections.items():
        (out / name).write_text(text)
    return sections


def list_dev_nodes(out: Path) -> str:
    done = subprocess.run(["sh", "-c", DEV_NODES_COMMAND], capture_output=True, text=True, check=False)
    (out / DEV_NODES).write_text(done.stdout)
    return done.stdout
