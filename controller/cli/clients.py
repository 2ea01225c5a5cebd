"""``controller clients``: what Claude Code and OpenClaw need to use a box, ready to paste.

    controller clients BOX --fleet FILE [--for claude-code|openclaw] [--json]
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from controller.cli.options import fleet_option, inventory_for, inventory_option, json_option, load
from controller.model.clients import CLIENTS


@click.command()
@click.argument("box")
@fleet_option
@inventory_option
@click.option("--for", "only", type=click.Choice(CLIENTS), default=None, help="Only this client.")
@json_option
def clients(box: str, fleet_path: Path, inventory: Path | None, only: str | None, as_json: bool) -> None:
    """Print, for each service of BOX, Claude Code's environment and settings and OpenClaw's provider entry.

    The output holds the box's API key: that is its point (nothing else prints it).
    """
    from controller.actions.clients import clients_for

    answer = clients_for(load(fleet_path), box, inventory_for(fleet_path, inventory), only)
    for service in answer["services"]:
        for warning in service["warnings"]:  # on stderr: what is printed stays ready to paste
            click.echo(f"warning: {box}: {warning}", err=True)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    for service in answer["services"]:
        click.echo(f"# {service['model']} at {service['base_url']} ({service['ctx']} tokens of context)")
        if "claude_code" in service:
            click.echo("## Claude Code: run these in a shell, then `claude`")
            for name, value in service["claude_code"]["env"].items():
                click.echo(f"export {name}={shlex.quote(value)}")
            click.echo("## Claude Code settings.json fragment (~/.claude/settings.json; the token stays in the env)")
            click.echo(json.dumps(service["claude_code"]["settings"], indent=2))
        if "openclaw" in service:
            entry = service["openclaw"]
            click.echo(f"## OpenClaw: merge into ~/.openclaw/openclaw.json, then use model {entry['model_ref']}")
            snippet = {"models": {"mode": "merge", "providers": {entry["provider_id"]: entry["provider"]}}}
            click.echo(json.dumps(snippet, indent=2))
        click.echo()
