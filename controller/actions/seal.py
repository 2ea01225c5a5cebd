"""``controller seal``: hand a certified box over to its buyer.

Stages, one way: refuse a box without a passed certification (``<inventory>/reports/<box>.certify.json``,
written by ``controller certify``), and answer a box whose report already records a seal without connecting
(the builder's key no longer opens it); make a new API key for each planned server; run
``playbooks/seal.yml`` (``roles/box_seal`` with ``roles/agent_clients``) on the box; record the seal in the
certification report and render the builder's reports again; write the buyer's copy, the only file that holds
the new keys.

The keys are made here and reach the box as the run's secret (``-e @file``, 0600, deleted after the run), so they
never travel back through Ansible's events or artifacts; they are never written to the inventory, the fleet or
the builder's report.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller.errors import ControllerError, RunError, SealRefused
from controller.inventory import Inventory, handed_over, sealed_at
from controller.model.fleet import Box, Fleet, check_api_key
from controller.model.serveplan import ServePlan

PLAYBOOK = "seal.yml"
STATS_KEY = "box_seal"
KEY_BYTES = 32  # secrets.token_urlsafe(32): 43 characters of [A-Za-z0-9_-], within the servers' key rule


class BoxSealed(ControllerError, exit_code=10):
    """The box was sealed and handed over to its buyer: its keys are the buyer's, and the builder's no longer open it."""


def refuse_sealed(inventory: Path, box_name: str, why: str) -> None:
    """Raise BoxSealed for a box this inventory sealed; ``why`` says what the command cannot do about it."""
    when = Inventory(inventory).sealed_at(box_name)
    if when is not None:
        raise BoxSealed(f"box {box_name} was {handed_over(when)}: {why}")


def check_certified(box: Box, report: Mapping[str, Any] | None, certify_command: str) -> None:
    """Refuse a box never certified from this inventory, or whose last certification failed."""
    if report is None:
        raise SealRefused(f"box {box.name} has no certification report; run `{certify_command}` first and seal it "
                          "once it passes")
    if report.get("passed") is not True:
        failed = [str(check.get("name")) for check in report.get("checks") or []
                  if isinstance(check, Mapping) and check.get("passed") is not True]
        which = f" ({', '.join(failed)})" if failed else ""
        raise SealRefused(f"box {box.name} failed its last certification{which}; fix what the report names and "
                          f"run `{certify_command}` again, then seal it once it passes")


def check_sealable(box: Box) -> None:
    """Refuse what seal cannot hand over yet, before any connection."""
    if box.os == "windows":
        raise SealRefused(f"box {box.name} runs Windows: seal hands over Linux boxes only; on Windows rotate the key "
                          "(delete the box's key file under its llama folder and provision again) and remove your "
                          "accounts by hand")
    if box.gateway is not None:
        raise SealRefused(f"box {box.name} runs a gateway, whose keys seal does not rotate yet; remove gateway: from "
                          "the box in the fleet file and provision it again, then certify and seal it")


def new_keys(plan: ServePlan) -> dict[str, str]:
    """A fresh random API key for each planned server (instance name -> key)."""
    keys = {service.name: secrets.token_urlsafe(KEY_BYTES) for service in plan.services}
    for name, key in keys.items():
        check_api_key(key, f"the new key of {name}")
    return keys


def seal_vars(box: Box, sealed: str) -> dict[str, Any]:
    """The play's variables that are no secret: the buyer's SSH keys and account, and when the seal ran."""
    return {"box_seal_buyer_authorized_keys": list(box.seal.buyer_authorized_keys),
            "box_seal_buyer_account": box.seal.buyer_account or "", "box_seal_buyer_sudo": box.seal.buyer_sudo,
            "box_seal_sealed_at": sealed}


def changes(data: Mapping[str, Any], box_name: str, key: str = "changed") -> list[str]:
    """The sentences the role published (set_stats) about ``box_name``: what it changed, or (``left``) what its
    last step could not do."""
    answer = (data.get(STATS_KEY) or {}).get(box_name) or {}
    return [str(line) for line in answer.get(key) or []]


def buyer_folder(fleet_path: Path) -> Path:
    """Where the buyer's copies go by default: ``buyer/`` beside the fleet file, outside the inventory."""
    return fleet_path.resolve().parent / "buyer"


def seal(fleet: Fleet, fleet_path: Path, box_name: str, inventory: Path, buyer_dir: Path,
         on_event: Any = None) -> dict[str, Any]:
    """Seal one certified box; returns ``{box, sealed, already, sealed_at, changed, reports, buyer_report}``.

    Raises SealRefused (before any connection) for a box not certified, or one seal cannot hand over, NotRendered
    for one this inventory has no plan for; RunError
    after the seal is recorded and the buyer's copy written when its last step could not do everything (it says
    what to do by hand).
    """
    from controller.reports.certify import write_buyer_copy, write_reports
    from controller.stages.render import connection_secrets
    from controller.stages.runner import run_playbook

    box = fleet.box(box_name)
    certify_command = f"controller certify {box.name} --fleet {fleet_path}"
    folder = Inventory(inventory)
    with folder.mutex(f"seal {box.name}"):
        report = folder.certify_report(box.name)
        already = sealed_at(report or {})
        if report is not None and already is not None:
            return {"box": box.name, "sealed": True, "already": True, "sealed_at": already,
                    "changed": list(report["seal"].get("changed") or []),
                    "reports": report.get("reports") or {"json": str(folder.certify_files(box.name)["json"])},
                    "buyer_report": None}
        check_certified(box, report, certify_command)
        check_sealable(box)
        plan = folder.plan(box.name)
        if not plan.services:
            raise SealRefused(f"box {box.name} has no planned server in {inventory} to rotate a key of; provision and "
                              f"certify it from this inventory (`controller provision {box.name} --fleet {fleet_path}`, "
                              f"then `{certify_command}`)")
        keys = new_keys(plan)
        when = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
        run = run_playbook(PLAYBOOK, inventory=inventory, limit=box.name,
                           # Only the login: the seal makes its own keys and downloads nothing, so the fleet's
                           # api_key and hf_token are neither read nor needed.
                           secrets={**connection_secrets(box, "box"), "box_seal_api_keys": keys},
                           extravars=seal_vars(box, when), on_event=on_event)
        changed, left = changes(run.data, box.name), changes(run.data, box.name, "left")
        report["seal"] = {"sealed_at": when, "changed": changed, **({"left": left} if left else {})}
        # The buyer's copy first: it is the only place the new keys live once this process ends.
        buyer_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        buyer = write_buyer_copy(buyer_dir, report, keys)
        reports = write_reports(folder, report)
    if left:
        raise RunError(f"box {box.name} was sealed at {when} (the buyer's copy: {buyer['markdown']}), but its last step "
                       f"could not {'; '.join(left)}: do that at the box's console")
    return {"box": box.name, "sealed": True, "already": False, "sealed_at": when, "changed": changed,
            "reports": reports, "buyer_report": buyer}
