"""Options several commands share, and the two things they derive from them (the fleet, the inventory folder)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from controller.model.fleet import Fleet

fleet_option = click.option(
    "--fleet", "fleet_path", type=click.Path(path_type=Path, dir_okay=False), required=True,
    help="Fleet file (YAML) naming the boxes.",
)
inventory_option = click.option(
    "--inventory", "inventory", type=click.Path(path_type=Path, file_okay=False), default=None,
    help="Folder for the rendered inventory, reports and artifacts [default: inventory/ beside the fleet file].",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def box_command(function):
    """A command on one box of a fleet: ``BOX --fleet FILE [--inventory DIR] [--json]``."""
    for decorate in (json_option, inventory_option, fleet_option, click.argument("box"), click.command()):
        function = decorate(function)
    return function


def inventory_for(fleet_path: Path, inventory: Path | None) -> Path:
    from controller.inventory import Inventory

    return inventory if inventory is not None else Inventory.beside(fleet_path).root


def load(fleet_path: Path) -> Fleet:
    from controller.model.fleet import load_fleet

    return load_fleet(fleet_path)
