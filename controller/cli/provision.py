"""``controller provision``, ``render`` and ``driver``: the commands that render a box's inventory and run its
playbooks (provision: playbooks/site.yml, driver: playbooks/driver.yml)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from controller.cli.lock import guard as lock_guard
from controller.cli.lock import note as lock_note
from controller.cli.options import box_command, fleet_option, inventory_for, inventory_option, json_option, load
from controller.errors import FleetRunError, PlanError, VerifyError

if TYPE_CHECKING:
    from controller.model.fleet import Fleet


@click.command()
@click.argument("boxes", nargs=-1, metavar="[BOX|GROUP]...")
@click.option("--all", "everything", is_flag=True, help="Every box of the fleet.")
@fleet_option
@inventory_option
@json_option
@click.option("--locked", is_flag=True,
              help="Install exactly what the fleet's lock says; refuse, before touching any box, whatever differs.")
def provision(boxes: tuple[str, ...], everything: bool, fleet_path: Path, inventory: Path | None,
              as_json: bool, locked: bool) -> None:
    """Probe, plan, render and run playbooks/site.yml on one box, several, a group of the fleet, or --all.

    Several boxes are probed and planned at once and provisioned by one Ansible run; one that fails does
    not stop the others, and the summary says which failed and why (exit 8). A box that serves only part of what
    its fleet entry wants (a model the plan could not place) is provisioned with what fits and is not as asked
    (exit 4; in a run over several boxes, its result says so). A workstation of the fleet
    (its `workstations:`) gets its accounts wired to the boxes it names instead (playbooks/clients.yml).
    """
    fleet = load(fleet_path)
    target = inventory_for(fleet_path, inventory)
    if len(boxes) == 1 and boxes[0] in fleet.workstations and not everything:
        provision_workstation(fleet, boxes[0], target, as_json)
        return
    if everything or len(boxes) != 1 or (boxes[0] in fleet.groups and boxes[0] not in fleet.boxes):
        names = fleet.select(boxes, everything)
        lock_guard(fleet, fleet_path, names, target, locked)  # before any box is touched
        provision_fleet(fleet, names, target, as_json, None if locked else fleet_path)
        return
    box = boxes[0]
    lock_guard(fleet, fleet_path, [box], target, locked)
    from controller.actions.provision import provision as run_provision
    from controller.cli.progress import Progress
    from controller.reports.provision import markdown, not_as_asked

    progress = Progress(as_json=as_json)
    report, result = run_provision(fleet, box, target, progress)
    progress.summary(result)
    if not locked:
        lock_note(fleet, fleet_path, target, [box], as_json)  # provisioning writes the lock
    click.echo(json.dumps({"type": "report", **report}) if as_json else markdown(report))
    missing = not_as_asked(report)
    if not report["verified"]:  # a server that does not answer outranks a model that was not placed
        raise VerifyError(f"{box}: verification failed; the report says which server answered what"
                          + (f"; and it is not provisioned as asked: {missing}" if missing else ""))
    if missing:
        raise PlanError(f"{box} is not provisioned as asked: {missing}; it serves the models that fit")


def provision_fleet(fleet: Fleet, names: list[str], inventory: Path, as_json: bool,
                    lock_for: Path | None = None) -> None:
    """Provision several boxes at once (controller.actions.fleetrun): live lines per box, then the summary table."""
    from controller.actions.fleetrun import failure_message, provision_many
    from controller.cli.progress import FleetProgress

    with FleetProgress(names, as_json=as_json) as progress:
        done = provision_many(fleet, names, inventory, on_event=progress, on_stage=progress.stage)
    progress.summary(done)
    if lock_for is not None:  # the fleet file whose lock records what the boxes that ran now have
        ran = [one.box for one in done.outcomes if one.result in ("ok", "not verified", "not as asked")]
        lock_note(fleet, lock_for, inventory, ran, as_json)
    if done.failed:
        raise FleetRunError(failure_message(done))


def provision_workstation(fleet: Fleet, name: str, inventory: Path, as_json: bool) -> None:
    """Wire a workstation's accounts to the boxes it names (controller.actions.workstation, playbooks/clients.yml)."""
    from controller.actions.workstation import provision_workstation as run_workstation
    from controller.cli.progress import Progress

    progress = Progress(as_json=as_json)
    report, result = run_workstation(fleet, name, inventory, progress)
    progress.summary(result)
    if as_json:
        click.echo(json.dumps({"type": "clients", **report}))
        return
    accounts = ", ".join(report["accounts"])
    for service in report["services"]:
        click.echo(f"{name}: {service['script']} ({service['model']} on {service['box']}, {service['base_url']}) "
                   f"for {accounts}")


@box_command
def render(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX and render its inventory without changing it (for plain ansible-playbook)."""
    from controller.actions.provision import prepare

    target = inventory_for(fleet_path, inventory)
    prepared = prepare(load(fleet_path), box, target)
    if as_json:
        click.echo(json.dumps({"inventory": str(target), "plan": prepared.plan.model_dump(mode="json")}))
    else:
        click.echo(f"Rendered {target}/hosts.yml and {target}/host_vars/{box}.yml; run:\n"
                   f"  ansible-playbook -i {target}/hosts.yml playbooks/site.yml --limit {box}")


@box_command
def driver(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX and install only its NVIDIA driver (playbooks/driver.yml); says when a reboot is needed."""
    from controller.actions.provision import install_driver
    from controller.cli.progress import Progress

    progress = Progress(as_json=as_json)
    section, result = install_driver(load(fleet_path), box, inventory_for(fleet_path, inventory), progress)
    progress.summary(result)
    if as_json:
        click.echo(json.dumps({"type": "driver", "box": box, **section}))
        return
    click.echo(f"{box}: {section.get('status') or 'done'}: {section.get('message') or ''}".rstrip(": "))
    for note in section.get("notes", []):
        click.echo(f"  note: {note}")
