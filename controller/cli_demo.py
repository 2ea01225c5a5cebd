"""``controller demo``: provision the built-in demo box end to end."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--down", is_flag=True, help="Remove the demo box instead.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def demo(down: bool, as_json: bool) -> None:
    """Provision a local demo box: a systemd container, the CPU engine and a generated tiny model."""
    from controller.lab import demo as lab_demo

    if down:
        removed = lab_demo.teardown()
        click.echo(f"removed {', '.join(removed)}" if removed else "no demo box is running")
        return

    import json

    from controller.fleet import load_fleet
    from controller.progress import Progress
    from controller.provision import provision
    from controller.report import markdown

    progress = Progress(as_json=as_json)
    if not as_json:
        click.echo("Preparing the demo box (the first run builds the CPU engine and the container image)...")
    with lab_demo.demo_fleet() as fleet_path:
        report, result = provision(load_fleet(fleet_path), lab_demo.DEMO_BOX, fleet_path.parent / "inventory",
                                   progress)
    progress.summary(result)
    if as_json:
        click.echo(json.dumps({"type": "report", **report}))
    else:
        click.echo(markdown(report))
        service = report["services"][0] if report["services"] else None
        click.echo(f"Fleet file and inventory: {fleet_path.parent}")
        if service:
            # Every server requires a key; the demo's was generated on the box, readable by root only.
            key = f"$(podman exec {lab_demo.DEMO_NAME} cat /etc/llama/keys/{service['name']}.key)"
            click.echo(f"Try it:  curl -s {service['endpoint']}/v1/chat/completions -H \"Authorization: Bearer {key}\" "
                       f"-H 'Content-Type: application/json' "
                       f"-d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"max_tokens\":8}}'")
        click.echo("Remove it: controller demo --down")
    if not report["verified"]:
        sys.exit(6)
