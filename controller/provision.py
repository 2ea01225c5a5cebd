"""The provisioning pipeline: probe -> plan -> render -> run -> verify -> report.

Each stage writes an artefact into the inventory folder; only the run changes the box. One
controller at a time works on an inventory folder (its ``.lock``); a second one waits. The probe
checks and records SSH host keys in ``<inventory>/known_hosts``, the file Ansible then checks against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.catalog import Catalog, load_catalog
from controller.errors import FleetError, PlanError
from controller.files import inventory_lock
from controller.fleet import Box, Fleet
from controller.planner import plan_box
from controller.probe.driver import driver_window_problem
from controller.profile import HardwareProfile
from controller.render import render_box
from controller.report import build_report, driver_section, write_report
from controller.runner import EventHandler, RunInterrupted, RunResult, run_playbook
from controller.serveplan import ServePlan
from controller.transports.known_hosts import known_hosts_file


@dataclass
class Prepared:
    box: Box
    catalog: Catalog
    profile: HardwareProfile
    plan: ServePlan
    probe_seconds: float


def check_driver(box: Box, profile: HardwareProfile) -> None:
    """Refuse a V100 box whose installed driver is outside the R570-R580 window; name the one to install.

    No driver at all is fine: the driver role installs one. A driver in the window is kept as it is.
    """
    if not any(gpu.is_v100 for gpu in profile.gpus) or not profile.driver.version:
        return
    problem = driver_window_problem(profile.driver.version, has_volta=True, os_family=profile.os.family or box.os,
                                    wsl=profile.os.wsl)
    if problem:
        raise PlanError(f"box {box.name}: {problem}; then provision again")


def box_and_catalog(fleet: Fleet, box_name: str) -> tuple[Box, Catalog]:
    box = fleet.box(box_name)
    catalog = load_catalog(fleet.catalogs)
    fleet.check_models_known(box, catalog.models)  # before touching the network
    return box, catalog


def prepare(fleet: Fleet, box_name: str, inventory: Path) -> Prepared:
    """Probe, plan and render one box; no change to the box."""
    box, catalog = box_and_catalog(fleet, box_name)
    with inventory_lock(inventory, f"render {box_name}"):
        return _prepare(fleet, box, catalog, inventory)


def _prepare(fleet: Fleet, box: Box, catalog: Catalog, inventory: Path) -> Prepared:
    from controller.probe.collect import probe_box

    profile, _raw, seconds = probe_box(box, known_hosts=known_hosts_file(inventory))
    check_driver(box, profile)
    plan = plan_box(box, profile, catalog)
    if not plan.services:
        reasons = "; ".join(f"{item.model}: {item.reason}" for item in plan.unplaced)
        raise PlanError(f"box {box.name}: no wanted model fits: {reasons}")
    render_box(inventory, fleet, box, profile, plan, catalog)
    return Prepared(box, catalog, profile, plan, seconds)


# The servers read the key as one line of a key file and compare it byte for byte with the header a
# client sends; HTTP drops spaces around header values and upstream skips key lines starting with "#".
# The same rule is checked by roles/llama_service (preflight) for hand-written inventories.
API_KEY_RULE = re.compile(r"[!-~]{16,256}")


def check_api_key(key: str, what: str) -> str:
    if not API_KEY_RULE.fullmatch(key) or key.startswith("#"):
        raise FleetError(f"{what}: use 16 to 256 printable ASCII characters with no spaces (letters, digits, "
                         f"punctuation; not starting with #); the key given has {len(key)} characters"
                         + ("" if API_KEY_RULE.fullmatch(key) else " and some outside that set"))
    return key


def secrets_for(box: Box) -> dict[str, str]:
    secrets = {}
    prefix = "win_" if box.os == "windows" else ""
    if box.api_key is not None:
        what = f"box {box.name} api_key"
        secrets[f"{prefix}llama_service_api_key"] = check_api_key(box.api_key.resolve(what), what)
    if box.hf_token is not None and box.os == "linux":  # the Windows model role downloads from a mirror
        secrets["gguf_model_hf_token"] = box.hf_token.resolve(f"box {box.name} hf_token")
    if box.password is not None:
        secrets["ansible_password"] = box.password.resolve(f"box {box.name} password")
    return secrets


def verify_data(result: RunResult, box: Box) -> dict[str, Any]:
    key = "win_llama_verify" if box.os == "windows" else "llama_verify"
    return (result.data.get(key) or {}).get(box.name, {})


def provision(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
              ) -> tuple[dict[str, Any], RunResult]:
    """Probe, plan, render, run site.yml and write the report; on Ctrl-C the report says where it stopped."""
    with inventory_lock(inventory, f"provision {box_name}"):
        prepared = prepare(fleet, box_name, inventory)
        box = prepared.box
        try:
            result = run_playbook("site.yml", inventory=inventory, limit=box.name, secrets=secrets_for(box),
                                  on_event=on_event)
        except RunInterrupted as stopped:
            report = build_report(box, prepared.profile, prepared.plan, stopped.result, {}, prepared.probe_seconds)
            json_path, _md = write_report(inventory / "reports", report)
            raise RunInterrupted(f"box {box.name}: {stopped} (report: {json_path})", stopped.result) from None
        report = build_report(box, prepared.profile, prepared.plan, result, verify_data(result, box),
                              prepared.probe_seconds)
        write_report(inventory / "reports", report)
    return report, result


def install_driver(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
                   ) -> tuple[dict[str, Any], RunResult]:
    """Probe the box and run playbooks/driver.yml: only the NVIDIA driver (and NCCL where the plan wants it).

    A box that names models is planned and rendered in full, as ``provision`` would, so the inventory stays
    whole; one that names none gets only the driver role's inputs.
    """
    from controller.probe.collect import probe_box

    box, catalog = box_and_catalog(fleet, box_name)
    with inventory_lock(inventory, f"driver {box_name}"):
        if box.models:
            _prepare(fleet, box, catalog, inventory)
        else:
            profile, _raw, _seconds = probe_box(box, known_hosts=known_hosts_file(inventory))
            check_driver(box, profile)
            render_box(inventory, fleet, box, profile, None, catalog)
        result = run_playbook("driver.yml", inventory=inventory, limit=box.name, secrets=secrets_for(box),
                              on_event=on_event)
    return driver_section(box, result), result
