"""``controller seal``: hand a certified box over to its buyer (new API keys, the builder's keys and traces gone)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.cli.options import box_command, inventory_for, load


@box_command
@click.option("--buyer-dir", "buyer_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Folder for the buyer's copy of the report, the only file with the new API keys "
                   "[default: buyer/ beside the fleet file].")
def seal(box: str, fleet_path: Path, inventory: Path | None, as_json: bool, buyer_dir: Path | None) -> None:
    """Seal certified BOX for its buyer: rotate the servers' API keys, clear shell history, provisioning logs and
    the journal, regenerate host keys and machine id on first boot, leave a first-boot note, and, last, leave the
    buyer's keys the only authorized SSH keys, lock the passwords and remove the account it connects as with its
    sudo rules (unless it is root or the fleet's seal.buyer_account). Records the seal in the certification
    report; the new API keys go only into the buyer's copy.

    Refused (exit 10) for a box without a passed certification; a sealed box is left alone (exit 0); exit 5 when
    the last step could not do everything (the seal is recorded and the line says what to do at the console)."""
    from controller.actions.seal import buyer_folder
    from controller.actions.seal import seal as seal_box
    from controller.cli.progress import Progress

    answer = seal_box(load(fleet_path), fleet_path, box, inventory_for(fleet_path, inventory),
                      buyer_dir if buyer_dir is not None else buyer_folder(fleet_path),
                      on_event=None if as_json else Progress())
    if as_json:
        click.echo(json.dumps(answer))
        return
    if answer["already"]:
        click.echo(f"{answer['box']}: already sealed at {answer['sealed_at']}; nothing to do")
        return
    click.echo(f"{answer['box']}: sealed at {answer['sealed_at']}")
    for line in answer["changed"]:
        click.echo(f"  {line}")
    click.echo("reports: " + ", ".join(str(path) for key, path in answer["reports"].items()
                                       if path and key != "pdf_note"))
    click.echo("buyer's copy (holds the new API keys; hand it over and keep no copy): "
               + ", ".join(answer["buyer_report"].values()))
