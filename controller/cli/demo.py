"""``controller demo``: provision the built-in demo box end to end, from a clone (the lab is not installed)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import click

from controller.errors import SetupError, VerifyError


def lab_demo() -> ModuleType:
    """The clone's lab/demo.py: the lab sits beside the package in a clone and is not installed with it."""
    import controller

    clone = Path(controller.__file__).resolve().parents[1]
    if not (clone / "lab" / "demo.py").is_file():
        raise SetupError("controller demo runs from a clone of the repository (./scripts/bootstrap.sh && "
                         ".venv/bin/controller demo): this install has no lab/ beside it")
    if str(clone) not in sys.path:
        sys.path.insert(0, str(clone))
    return importlib.import_module("lab.demo")


@click.command()
@click.option("--boxes", type=click.IntRange(1, 32), default=1, show_default=True,
              help="How many demo boxes, in one fleet file, provisioned at once.")
@click.option("--down", is_flag=True, help="Remove the demo boxes instead (all of them).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def demo(boxes: int, down: bool, as_json: bool) -> None:
    """Provision a local demo box: a systemd container, the CPU engine and a generated tiny model.

    With --boxes N, N such boxes (demo, demo2, ...) in one fleet file, provisioned like `controller provision
    --all`.
    """
    lab = lab_demo()
    if down:
        removed = lab.teardown()
        click.echo(f"removed {', '.join(removed)}" if removed else "no demo box is running")
        return
    if boxes > 1:
        demo_fleet(lab, boxes, as_json)
        return

    from controller.actions.provision import provision
    from controller.cli.progress import Progress
    from controller.cli.provision import lock_note
    from controller.inventory import Inventory
    from controller.model.fleet import load_fleet
    from controller.reports.provision import markdown

    progress = Progress(as_json=as_json)
    if not as_json:
        click.echo("Preparing the demo box (the first run builds the CPU engine and the container image)...")
    removed: list[str] = []
    with lab.demo_fleet(removed=removed) as fleet_path:
        say_removed(removed, [lab.DEMO_BOX], as_json)
        fleet = load_fleet(fleet_path)
        # As `controller provision` does: the lock records what the box runs (and drops boxes an earlier --boxes
        # left).
        done = provision(fleet, [lab.DEMO_BOX], Inventory.beside(fleet_path).root, fleet_path=fleet_path,
                         raise_failures=True, on_event=progress)
    if done.run is not None:
        progress.summary(done.run, done.strategy)
    lock_note(done, as_json)
    report = done.reports[lab.DEMO_BOX]
    if as_json:
        click.echo(json.dumps({"type": "report", **report}))
    else:
        click.echo(markdown(report))
        service = report["services"][0] if report["services"] else None
        click.echo(f"Fleet file and inventory: {fleet_path.parent}")
        if service:
            # Every server requires a key; the demo's was generated on the box, readable by root only.
            key = f"$(podman exec {lab.DEMO_NAME} cat /etc/llama/keys/{service['name']}.key)"
            click.echo(f"Try it:  curl -s {service['endpoint']}/v1/chat/completions -H \"Authorization: Bearer {key}\" "
                       f"-H 'Content-Type: application/json' "
                       f"-d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"max_tokens\":8}}'")
        click.echo(f"Claude Code and OpenClaw: controller clients {lab.DEMO_BOX} --fleet {fleet_path}")
        click.echo("Remove it: controller demo --down")
    if not report["verified"]:
        raise VerifyError(f"{lab.DEMO_BOX}: verification failed; the report says which server answered what")


def demo_fleet(lab: ModuleType, boxes: int, as_json: bool) -> None:
    """``controller demo --boxes N``: N demo boxes in one fleet file, provisioned by one run."""
    from controller.cli.provision import provision_fleet
    from controller.inventory import Inventory
    from controller.model.fleet import load_fleet

    if not as_json:
        click.echo(f"Preparing {boxes} demo boxes (the first run builds the CPU engine and the container image)...")
    removed: list[str] = []
    with lab.demo_fleet(boxes=boxes, removed=removed) as fleet_path:
        fleet = load_fleet(fleet_path)
        say_removed(removed, list(fleet.boxes), as_json)
        try:
            provision_fleet(fleet, sorted(fleet.boxes, key=_box_order), Inventory.beside(fleet_path).root, as_json,
                            fleet_path)
        finally:
            if not as_json:
                click.echo(f"Fleet file and inventory: {fleet_path.parent}")
                click.echo("Remove them: controller demo --down")


def say_removed(removed: list[str], kept: list[str], as_json: bool) -> None:
    """Name the demo boxes an earlier ``--boxes N`` left that this run removed (their containers are gone)."""
    if not removed:
        return
    if as_json:
        click.echo(json.dumps({"type": "removed", "boxes": removed, "fleet": kept}))
        return
    click.echo(f"Removed demo box{'es' * (len(removed) > 1)} {', '.join(removed)} (left from an earlier `controller "
               f"demo --boxes N`): the fleet file now names {', '.join(kept)}; `controller demo --boxes N` brings "
               f"them back")


def _box_order(name: str) -> int:
    """demo, demo2, ..., demo10 in that order."""
    digits = name.removeprefix("demo")
    return int(digits) if digits.isdigit() else 1
