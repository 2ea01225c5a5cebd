"""``controller lock``: write the fleet's lock (``<fleet>.lock.yml``), compare the fleet with it, or refresh it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.cli.options import fleet_option, inventory_for, inventory_option, json_option, load
from controller.errors import LockError


@click.command()
@click.argument("boxes", nargs=-1)
@fleet_option
@inventory_option
@click.option("--update", is_flag=True, help="Refresh the lock from what the boxes plan to now, and say what changed.")
@json_option
def lock(boxes: tuple[str, ...], fleet_path: Path, inventory: Path | None, update: bool, as_json: bool) -> None:
    """Probe and plan the fleet's boxes (every box, or BOXES) and write the lock beside the fleet file.

    With a lock already there, compare and write nothing (exit 7 when the boxes would differ); --update
    writes what they plan to now, and drops the boxes the fleet no longer names.
    """
    from controller.actions.fleetrun import lock_fleet

    outcome = lock_fleet(load(fleet_path), fleet_path, inventory_for(fleet_path, inventory), list(boxes), update)
    current = outcome.written or not outcome.changes
    if as_json:
        click.echo(json.dumps({"lock": str(outcome.path), "written": outcome.written, "changes": outcome.changes,
                               "boxes": sorted(outcome.lock.boxes)}))
    else:
        state = "written" if outcome.written else ("up to date" if current else "differs from the boxes planned now")
        click.echo(f"{outcome.path}: {state} ({len(outcome.lock.boxes)} boxes)")
        for line in outcome.changes:
            click.echo(f"  {line}")
    if not current:
        raise LockError(f"{outcome.path} differs from what the boxes plan to now ({outcome.changes[0]}); run "
                        f"`controller lock --fleet {fleet_path} --update` to accept it")
