"""``python -m lab.target_cli image|up|down|status``: manage the lab's systemd targets by hand."""

from __future__ import annotations

import sys

import click

from controller.errors import ControllerError
from lab.image import ensure_image
from lab.target import LOOPBACK, MANUAL_OWNER, Target, cleanup_stale, list_targets, remove_containers


@click.group(name="target")
def cli() -> None:
    """Manage the lab's systemd target containers."""


@cli.command()
def image() -> None:
    """Build or import the target image (also tagged :latest for molecule) and print its tag."""
    click.echo(ensure_image())


@cli.command()
@click.option("--name", help="Container name (default: a random v100box-target-* name).")
@click.option("--port", type=int, help="Loopback port for sshd (default: a free one).")
def up(name: str | None, port: int | None) -> None:
    """Start a target that stays up until `down`, and print how to reach it."""
    target = Target.start(name=name, ssh_port=port, owner=MANUAL_OWNER)
    click.echo(f"{target.name} is up; ssh with:")
    click.echo("  " + " ".join(target.ssh_argv()))


@cli.command()
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Remove every lab target, including other sessions' ones.")
def down(names: tuple[str, ...], all_: bool) -> None:
    """Remove the named targets (default: manual ones and those whose owner is gone)."""
    if all_:
        removed = [record.name for record in list_targets()]
        remove_containers(removed)
    elif names:
        known = {record.name for record in list_targets()}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise click.ClickException(f"not a lab target: {', '.join(unknown)} (see `status`)")
        removed = list(names)
        remove_containers(removed)
    else:
        removed = cleanup_stale(include_manual=True)
    click.echo("removed: " + (", ".join(removed) or "nothing"))


@cli.command()
def status() -> None:
    """List lab targets with their ssh command."""
    records = list_targets()
    if not records:
        click.echo("no lab targets")
    for record in records:
        key = f"-i {record.key_path} " if record.key_path else ""
        click.echo(
            f"{record.name}  {record.state}  owner={record.owner}  "
            f"ssh {key}-p {record.ssh_port} root@{LOOPBACK}"
        )


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(1)
    except ControllerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
