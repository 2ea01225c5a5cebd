"""``controller provision``, ``render`` and ``driver``: the commands that render a box's inventory and run its
playbooks (provision: playbooks/site.yml, driver: playbooks/driver.yml)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.cli.options import box_command, inventory_for, load
from controller.errors import VerifyError


@box_command
def provision(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX, plan its services, render the inventory and run playbooks/site.yml on it."""
    from controller.progress import Progress
    from controller.provision import provision as run_provision
    from controller.report import markdown

    progress = Progress(as_json=as_json)
    report, result = run_provision(load(fleet_path), box, inventory_for(fleet_path, inventory), progress)
    progress.summary(result)
    click.echo(json.dumps({"type": "report", **report}) if as_json else markdown(report))
    if not report["verified"]:
        raise VerifyError(f"{box}: verification failed; the report says which server answered what")


@box_command
def render(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX and render its inventory without changing it (for plain ansible-playbook)."""
    from controller.provision import prepare

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
    from controller.progress import Progress
    from controller.provision import install_driver

    progress = Progress(as_json=as_json)
    section, result = install_driver(load(fleet_path), box, inventory_for(fleet_path, inventory), progress)
    progress.summary(result)
    if as_json:
        click.echo(json.dumps({"type": "driver", "box": box, **section}))
        return
    click.echo(f"{box}: {section.get('status') or 'done'}: {section.get('message') or ''}".rstrip(": "))
    for note in section.get("notes", []):
        click.echo(f"  note: {note}")
