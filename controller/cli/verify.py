"""``controller verify``: run playbooks/verify.yml on a rendered box and print what its servers answered."""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.cli.options import box_command, inventory_for, load


@box_command
def verify(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Run playbooks/verify.yml on BOX's rendered inventory and print what its servers answered."""
    from controller.cli.progress import Progress
    from controller.stages.verify import run_verify

    progress = Progress(as_json=as_json)
    section, result = run_verify(load(fleet_path), box, inventory_for(fleet_path, inventory), progress)
    progress.summary(result)
    click.echo(json.dumps(section, indent=None if as_json else 2))
