"""``controller certify``: the acceptance checks of a provisioned box, and the buyer's report.

Stages, one way: refuse a box this inventory never provisioned; probe it afresh for its identity (SSH or WinRM,
the inventory's known host keys); run ``playbooks/certify.yml`` (read what it runs as status does, the servers'
checks with a tool-call round trip, streaming and the server's timings, the thermal guard's events, the power
limits, the burn-in when asked for); decide check by check (``controller.stages.verify.certify``, pure); write the report
in Markdown, JSON and HTML (``controller.reports.certify``). The box is not changed.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

from controller.actions.lock import lock_path, read_lock, template_digests
from controller.errors import ControllerError, FleetError, NotRendered
from controller.inventory import Inventory
from controller.model.catalog import load_catalog
from controller.model.fleet import Box, Fleet
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan
from controller.stages.render import guard_enabled, secrets_for
from controller.stages.runner import EventHandler, RunResult, run_playbook
from controller.stages.verify import results
from controller.stages.verify.certify import STATS_KEY, evaluate
from controller.stages.verify.status import STATS_KEY as STATUS_KEY

PLAYBOOK = "certify.yml"
REPORT_VERSION = 1
MAX_BURN_IN_S = 7 * 24 * 3600
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


class CertificationFailed(ControllerError, exit_code=6):
    """The box was certified and some check failed (the report says which and why)."""


def parse_duration(text: str) -> float:
    """``25m``, ``1h30m``, ``90s``, ``90`` (seconds) -> seconds; anything else is refused with the forms it takes."""
    value = text.strip().lower()
    match = _DURATION.fullmatch(value) if value and not value.isdigit() else None
    if value.isdigit():
        seconds = float(value)
    elif match and any(match.groups()):
        hours, minutes, secs = (int(part or 0) for part in match.groups())
        seconds = float(hours * 3600 + minutes * 60 + secs)
    else:
        raise FleetError(f"--burn-in {text!r} is not a duration: give one like 25m, 1h30m, 90s or 600 (seconds)")
    if not 0 < seconds <= MAX_BURN_IN_S:
        raise FleetError(f"--burn-in {text!r}: give more than 0 s and at most 7 days")
    return seconds


def thermal_settings(box: Box, plan: ServePlan) -> dict[str, Any] | None:
    """The thermal guard the box runs (its fleet settings), or None where it installs none."""
    return box.thermal.model_dump(mode="json") if guard_enabled(box, plan) else None


def identity(profile: HardwareProfile) -> dict[str, Any]:
    return {
        "gpus": [gpu.model_dump(mode="json") for gpu in profile.gpus],
        "driver": profile.driver.model_dump(mode="json"),
        "nvlink": [{"gpus": [i, j], "links": links} for i, j, links in profile.nvlink.pairs],
        "cpu": profile.cpu.model_dump(mode="json", include={"model", "cores", "threads"}),
        "memory_mib": profile.memory_mib,
        "disks": [disk.model_dump(mode="json") for disk in profile.disks],
        "os": f"{profile.os.name or ''} {profile.os.version or ''}".strip() or None,
        "warnings": profile.warnings,
    }


def installed(plan: ServePlan, status: dict[str, Any] | None, locked: Any) -> dict[str, Any]:
    templates = template_digests(plan.templates())
    return {
        "engines": [{"id": engine.id, "slot": engine.slot, "commit": engine.commit,
                     "sha256": engine.download.sha256 if engine.download else None,
                     **next((row for row in (status or {}).get("engines", []) if row.get("id") == engine.id), {})}
                    for engine in plan.engines],
        "models": (status or {}).get("models") or [{"file": model.file, "sha256": model.sha256,
                                                    "size_bytes": model.size_bytes} for model in plan.models],
        "templates": [{"name": name, "sha256": digest} for name, digest in templates.items()],
        "units": [{"name": f"{service['name']}.service", "state": service.get("state"),
                   "enabled": service.get("enabled"), "active": service.get("active")}
                  for service in (status or {}).get("services", [])],
        "plan": {"services": [service.model_dump(mode="json", include={
            "name", "model", "engine", "gpus", "ctx", "parallel", "split_mode", "cpu_offload", "cache_type_k",
            "cache_type_v", "host", "port", "reasons", "draft"}) for service in plan.services],
                 "unplaced": [item.model_dump(mode="json") for item in plan.unplaced],
                 "idle_gpus": [item.model_dump(mode="json") for item in plan.idle_gpus]},
        "lock": None if locked is None else locked.model_dump(mode="json"),
    }


def certify(fleet: Fleet, fleet_path: Path, box_name: str, inventory: Path, *, burn_in_s: float = 0,
            on_event: EventHandler | None = None) -> dict[str, Any]:
    """Certify one provisioned box; returns the report (with ``reports``: the paths written).

    Raises NotRendered for a box this inventory has no plan or provisioning report for.
    """
    from controller.reports.certify import write_reports
    from controller.stages.probe.collect import probe_box

    box = fleet.box(box_name)
    catalog = load_catalog(fleet.catalogs)
    provision = f"controller provision {box.name} --fleet {fleet_path}"
    folder = Inventory(inventory)
    with folder.mutex(f"certify {box.name}"):
        plan = folder.find_plan(box.name)
        if plan is None or folder.report(box.name) is None:
            raise NotRendered(f"box {box.name} was never provisioned from {inventory}: run `{provision}` first, "
                              "then certify it")
        profile, _raw, _seconds = probe_box(box, known_hosts=folder.known_hosts_file)
        run = run_playbook(PLAYBOOK, inventory=inventory, limit=box.name, secrets=secrets_for(box),
                           extravars={"llama_verify_burn_in_s": burn_in_s,
                                      # a card held at the fleet's power limit caps its power by design
                                      "llama_verify_burn_in_tolerated_throttle":
                                          ["sw_power_cap"] if box.power_limit_w else []},
                           on_event=on_event,
                           raise_on_failure=False)
        lock = read_lock(lock_path(fleet_path))
        locked = None if lock is None else lock.boxes.get(box.name)
        state = (run.data.get(STATUS_KEY) or {}).get(box.name)
        extras = (run.data.get(STATS_KEY) or {}).get(box.name) or {}
        verify = results(run, box)
        found = evaluate(box, plan, profile, catalog, run, verify, state, extras,
                         fleet_path=str(fleet_path), locked=locked,
                         engine_root=folder.engine_root(box.name, windows=box.os == "windows"),
                         burn_in_s=burn_in_s, thermal=thermal_settings(box, plan),
                         power_planned=bool(box.power_limit_w))
        report = {
            "box": box.name,
            "address": box.address,
            "passed": all(item["passed"] for item in found["checks"]),
            "generated": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
            "certify_version": REPORT_VERSION,
            "burn_in_s": burn_in_s or None,
            "checks": found["checks"],
            "not_checked": found["not_checked"],
            "identity": identity(profile),
            "installed": installed(plan, found["status"], locked),
            "endpoints": {service.name: {"endpoint": f"http://{service.host}:{service.port}", "model": service.model,
                                         **(verify.get(service.name) or {})} for service in plan.services},
            "throughput": found["throughput"],
            "gpu_memory": found["gpu_memory"],
            "burn_in": found["burn_in"],
            "thermal_guard": found["thermal_guard"],
            "power": found["power"],
            "run": _run_summary(run),
            # A seal recorded in the box's last report stays in the next one (a sealed box was sealed).
            "seal": (folder.certify_report(box.name) or {}).get("seal"),
        }
        report["reports"] = write_reports(folder, report)
    return report


def _run_summary(run: RunResult) -> dict[str, Any]:
    return {"playbook": run.playbook, "status": run.status, "elapsed": round(run.elapsed, 1),
            "failed": [f"{task.task}: {task.message}" for task in run.failed[:5]]}
