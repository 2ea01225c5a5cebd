"""``controller provision``, ``render`` and ``driver``: the commands that render a box's inventory and run its
playbooks (provision: playbooks/site.yml, driver: playbooks/driver.yml)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from controller.cli.options import box_command, fleet_option, inventory_for, inventory_option, json_option, load
from controller.errors import FleetRunError, PlanError, VerifyError

if TYPE_CHECKING:
    from controller.actions.fleetrun import FleetRun
    from controller.model.fleet import Fleet


@click.command()
@click.argument("boxes", nargs=-1, metavar="[BOX|GROUP]...")
@click.option("--all", "everything", is_flag=True, help="Every box of the fleet.")
@fleet_option
@inventory_option
@json_option
@click.option("--locked", is_flag=True,
              help="Install exactly what the fleet's lock says; refuse, before touching any box, whatever differs.")
@click.option("--full", is_flag=True,
              help="Run every role on every box, even on a box that still matches the record of its last full run "
                   "(a converged box otherwise ends after one comparison and the servers' checks).")
@click.option("-v", "--verbose", is_flag=True,
              help="A line for every task result (the run's artifacts keep them too); by default a line per role "
                   "with its counts, and one for each task that changed something or failed.")
def provision(boxes: tuple[str, ...], everything: bool, fleet_path: Path, inventory: Path | None,
              as_json: bool, locked: bool, full: bool, verbose: bool) -> None:
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
        provision_fleet(fleet, fleet.select(boxes, everything), target, as_json, fleet_path, locked=locked, full=full)
        return
    provision_box(fleet, boxes[0], target, as_json, fleet_path, locked=locked, full=full, verbose=verbose)


def provision_box(fleet: Fleet, box: str, inventory: Path, as_json: bool, fleet_path: Path,
                  locked: bool = False, full: bool = False, verbose: bool = False) -> None:
    """One box: its progress, the run's summary, then its report; its own error and exit code when it fails."""
    from controller.actions.provision import provision as run_provision
    from controller.cli.progress import Progress
    from controller.inventory import Inventory
    from controller.reports.provision import markdown, not_as_asked

    folder = Inventory(inventory)
    progress = Progress(as_json=as_json, verbose=verbose, expected=folder.expected_tasks("site.yml", 1))
    try:
        done = run_provision(fleet, [box], inventory, fleet_path=fleet_path, locked=locked, raise_failures=True,
                             on_event=progress, full=full)
    finally:
        progress.close()
    if done.run is not None:
        progress.summary(done.run, done.strategy)
        if not progress.converged:
            folder.record_tasks("site.yml", 1, progress.done)
    lock_note(done, as_json)
    report = done.reports[box]
    click.echo(json.dumps({"type": "report", **report}) if as_json else markdown(report))
    missing = not_as_asked(report)
    if not report["verified"]:  # a server that does not answer outranks a model that was not placed
        raise VerifyError(f"{box}: verification failed; the report says which server answered what"
                          + (f"; and it is not provisioned as asked: {missing}" if missing else ""))
    if missing:
        raise PlanError(f"{box} is not provisioned as asked: {missing}; it serves the models that fit")


def provision_fleet(fleet: Fleet, names: list[str], inventory: Path, as_json: bool, fleet_path: Path | None,
                    locked: bool = False, full: bool = False) -> None:
    """Provision several boxes at once: live lines per box, then the summary table; exit 8 when any failed."""
    from controller.actions.fleetrun import failure_message
    from controller.actions.provision import provision as run_provision
    from controller.cli.progress import FleetProgress

    with FleetProgress(names, as_json=as_json) as progress:
        done = run_provision(fleet, names, inventory, fleet_path=fleet_path, locked=locked, on_event=progress,
                             on_stage=progress.stage, full=full)
    progress.summary(done)
    lock_note(done, as_json)
    if done.failed:
        raise FleetRunError(failure_message(done))


def lock_note(done: FleetRun, as_json: bool) -> None:
    """What provisioning recorded in the fleet's lock for the boxes that ran, and what that changed."""
    if done.lock_changes is None:
        return
    if as_json:
        click.echo(json.dumps({"type": "lock", "lock": str(done.lock_file), "changes": done.lock_changes}))
    elif done.lock_changes:
        click.echo(f"{done.lock_file}: " + "; ".join(done.lock_changes))


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
    from controller.inventory import Inventory

    target = inventory_for(fleet_path, inventory)
    prepared = prepare(load(fleet_path), box, target)
    if as_json:
        click.echo(json.dumps({"inventory": str(target), "plan": prepared.plan.model_dump(mode="json")}))
    else:
        folder = Inventory(target)
        click.echo(f"Rendered {folder.hosts_file} and {folder.host_vars_file(box)}; run:\n"
                   f"  ansible-playbook -i {folder.hosts_file} v100box.llm.site --limit {box}\n"
                   "(from the clone, whose ansible.cfg finds the collection v100box.llm; elsewhere install it first)")


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
