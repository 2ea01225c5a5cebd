"""The provisioning pipeline: probe -> plan -> render -> run -> verify -> report.

Each stage writes an artefact into the inventory folder; only the run changes the box. One
controller at a time works on an inventory folder (its ``.lock``); a second one waits. The probe
checks and records SSH host keys in ``<inventory>/known_hosts``, the file Ansible then checks against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.errors import PlanError
from controller.files import inventory_lock
from controller.model.catalog import Catalog, load_catalog
from controller.model.fleet import Box, Fleet
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan
from controller.reports.provision import build_report, driver_section, write_report
from controller.stages.planner import plan_box, plan_driver
from controller.stages.planner.gateway import plan_gateway
from controller.stages.probe.driver import driver_window_problem
from controller.stages.render import render_box, secrets_for
from controller.stages.runner import EventHandler, RunInterrupted, RunResult, run_playbook
from controller.stages.transports.known_hosts import known_hosts_file
from controller.stages.verify import results


@dataclass
class Prepared:
    box: Box
    catalog: Catalog
    profile: HardwareProfile
    plan: ServePlan
    probe_seconds: float


def check_driver(box: Box, profile: HardwareProfile) -> None:
    """Refuse a V100 box whose installed driver is outside the driver window (controller.model.rules); name the
    one to install.

    No driver at all is fine: the driver role installs one. A driver in the window is kept as it is.
    """
    if not any(gpu.is_v100 for gpu in profile.gpus) or not profile.driver.version:
        return
    problem = driver_window_problem(profile.driver.version, has_volta=True, os_family=profile.os.family or box.os,
                                    wsl=profile.os.wsl)
    if problem:
        raise PlanError(f"box {box.name}: {problem}; then provision again")


def rendered_plan(inventory: Path, box_name: str) -> ServePlan | None:
    """The plan last rendered for a box (None: never rendered, or not a plan file)."""
    path = inventory / "plans" / f"{box_name}.json"
    try:
        return ServePlan.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def add_gateway(fleet: Fleet, box: Box, plan: ServePlan, inventory: Path) -> None:
    """Plan the box's gateway (when the fleet gives it one) over the plans rendered for the boxes it routes to."""
    if box.gateway is not None:
        plan.gateway = plan_gateway(box, plan, {name: (fleet.box(name), rendered_plan(inventory, name))
                                                for name in box.gateway.boxes if name != box.name})


def box_and_catalog(fleet: Fleet, box_name: str) -> tuple[Box, Catalog]:
    box = fleet.box(box_name)
    catalog = load_catalog(fleet.catalogs)
    fleet.check_models_known(box, catalog.models)  # before touching the network
    for wanted in box.models:
        if wanted.engine is not None:
            catalog.engine(wanted.engine)  # an engine pack the fleet names: known before any connection
    return box, catalog


def prepare(fleet: Fleet, box_name: str, inventory: Path) -> Prepared:
    """Probe, plan and render one box; no change to the box."""
    box, catalog = box_and_catalog(fleet, box_name)
    with inventory_lock(inventory, f"render {box_name}"):
        return _prepare(fleet, box, catalog, inventory)


def _prepare(fleet: Fleet, box: Box, catalog: Catalog, inventory: Path) -> Prepared:
    from controller.stages.probe.collect import probe_box

    profile, _raw, seconds = probe_box(box, known_hosts=known_hosts_file(inventory))
    check_driver(box, profile)
    plan = plan_box(box, profile, catalog)
    if not plan.services:
        reasons = "; ".join(f"{item.model}: {item.reason}" for item in plan.unplaced)
        raise PlanError(f"box {box.name}: no wanted model fits: {reasons}")
    add_gateway(fleet, box, plan, inventory)
    render_box(inventory, fleet, box, profile, plan)
    return Prepared(box, catalog, profile, plan, seconds)


def provision(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
              ) -> tuple[dict[str, Any], RunResult]:
    """Probe, plan, render, run site.yml (its last role runs the checks) and write the report.

    On Ctrl-C the report says where the run stopped, and the box is not verified.
    """
    with inventory_lock(inventory, f"provision {box_name}"):
        prepared = prepare(fleet, box_name, inventory)
        box = prepared.box
        try:
            result = run_playbook("site.yml", inventory=inventory, limit=box.name,
                                  secrets=secrets_for(box, fleet), on_event=on_event)
        except RunInterrupted as stopped:
            report = build_report(box, prepared.profile, prepared.plan, stopped.result,
                                  results(stopped.result, box), prepared.probe_seconds)
            json_path, _md = write_report(inventory / "reports", report)
            raise RunInterrupted(f"box {box.name}: {stopped} (report: {json_path})", stopped.result) from None
        report = build_report(box, prepared.profile, prepared.plan, result, results(result, box),
                              prepared.probe_seconds)
        write_report(inventory / "reports", report)
    return report, result


def install_driver(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
                   ) -> tuple[dict[str, Any], RunResult]:
    """Probe the box and run playbooks/driver.yml: only the NVIDIA driver (and NCCL where the plan wants it).

    A box that names models is planned and rendered in full, as ``provision`` would, so the inventory stays
    whole; one that names none gets only the driver role's inputs.
    """
    from controller.stages.probe.collect import probe_box

    box, catalog = box_and_catalog(fleet, box_name)
    with inventory_lock(inventory, f"driver {box_name}"):
        if box.models:
            _prepare(fleet, box, catalog, inventory)
        else:
            profile, _raw, _seconds = probe_box(box, known_hosts=known_hosts_file(inventory))
            check_driver(box, profile)
            render_box(inventory, fleet, box, profile, None, plan_driver(box, profile, catalog))
        result = run_playbook("driver.yml", inventory=inventory, limit=box.name, secrets=secrets_for(box),
                              on_event=on_event)
    return driver_section(box, result), result
