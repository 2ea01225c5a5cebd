"""``controller``: probe, plan, render, provision and verify V100 LLM boxes.

One action maps to one playbook: ``provision`` runs playbooks/site.yml, ``driver`` playbooks/driver.yml,
``verify`` playbooks/verify.yml.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from controller.errors import ControllerError

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

fleet_option = click.option(
    "--fleet", "fleet_path", type=click.Path(path_type=Path, dir_okay=False), required=True,
    help="Fleet file (YAML) naming the boxes.",
)
inventory_option = click.option(
    "--inventory", "inventory", type=click.Path(path_type=Path, file_okay=False), default=None,
    help="Folder for the rendered inventory, reports and artifacts [default: inventory/ beside the fleet file].",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")

INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE: a bug in the controller, not in its inputs
INTERRUPTED_EXIT = 130


def log_folder() -> Path:
    """Where tracebacks of internal errors are kept: $XDG_STATE_HOME/v100-llm-box/logs."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "v100-llm-box" / "logs"


def _report_internal_error(exc: BaseException) -> None:
    """One line for the operator; the traceback goes to a log file for the bug report."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    try:
        folder = log_folder()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = folder / f"controller-{stamp}-{os.getpid()}.log"
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as log:  # private
            log.write(f"controller {' '.join(sys.argv[1:])}\n"
                      + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        where = f"the traceback is in {path}"
    except OSError as log_error:
        where = f"the traceback could not be saved ({log_error.strerror}); set XDG_STATE_HOME to a writable folder"
    err_console.print(escape(f"internal error: {summary}; this is a bug in the controller: {where} "
                             "(attach it to a report)"))


def _inventory_for(fleet_path: Path, inventory: Path | None) -> Path:
    return inventory if inventory is not None else fleet_path.resolve().parent / "inventory"


def _load(fleet_path: Path):
    from controller.fleet import load_fleet

    return load_fleet(fleet_path)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="v100-llm-box")
def cli() -> None:
    """Provision Tesla V100 boxes that serve GGUF models with llama.cpp."""


@cli.command()
@click.argument("box")
@fleet_option
@inventory_option
@json_option
def provision(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX, plan its services, render the inventory and run playbooks/site.yml on it."""
    from controller.progress import Progress
    from controller.provision import provision as run_provision
    from controller.report import markdown

    progress = Progress(as_json=as_json)
    report, result = run_provision(_load(fleet_path), box, _inventory_for(fleet_path, inventory), progress)
    progress.summary(result)
    if as_json:
        click.echo(json.dumps({"type": "report", **report}))
    else:
        click.echo(markdown(report))
    if not report["verified"]:
        sys.exit(6)


@cli.command()
@click.argument("box")
@fleet_option
@inventory_option
@json_option
def render(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX and render its inventory without changing it (for plain ansible-playbook)."""
    from controller.provision import prepare

    target = _inventory_for(fleet_path, inventory)
    prepared = prepare(_load(fleet_path), box, target)
    if as_json:
        click.echo(json.dumps({"inventory": str(target), "plan": prepared.plan.model_dump(mode="json")}))
    else:
        click.echo(f"Rendered {target}/hosts.yml and {target}/host_vars/{box}.yml; run:\n"
                   f"  ansible-playbook -i {target}/hosts.yml playbooks/site.yml --limit {box}")


@cli.command()
@click.argument("box")
@fleet_option
@inventory_option
@json_option
def driver(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Probe BOX and install only its NVIDIA driver (playbooks/driver.yml); says when a reboot is needed."""
    from controller.progress import Progress
    from controller.provision import install_driver

    progress = Progress(as_json=as_json)
    section, result = install_driver(_load(fleet_path), box, _inventory_for(fleet_path, inventory), progress)
    progress.summary(result)
    if as_json:
        click.echo(json.dumps({"type": "driver", "box": box, **section}))
        return
    click.echo(f"{box}: {section.get('status') or 'done'}: {section.get('message') or ''}".rstrip(": "))
    for note in section.get("notes", []):
        click.echo(f"  note: {note}")


@cli.command()
@click.argument("box")
@fleet_option
@inventory_option
@json_option
def verify(box: str, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Run playbooks/verify.yml on BOX's rendered inventory and print what its servers answered."""
    from controller.progress import Progress
    from controller.provision import secrets_for, verify_data
    from controller.runner import run_playbook

    fleet = _load(fleet_path)
    target = fleet.box(box)
    folder = _inventory_for(fleet_path, inventory)
    if not (folder / "host_vars" / f"{box}.yml").exists():
        raise click.ClickException(f"{folder} has no rendered inventory for {box}; run `controller render` first")
    progress = Progress(as_json=as_json)
    result = run_playbook("verify.yml", inventory=folder, limit=box, secrets=secrets_for(target), on_event=progress)
    progress.summary(result)
    click.echo(json.dumps(verify_data(result, target), indent=None if as_json else 2))


def _register_commands() -> None:
    """Commands defined in their own modules; imported here so ``--help`` lists them."""
    from controller.cli_demo import demo
    from controller.cli_estimate import estimate
    from controller.cli_plan import plan
    from controller.cli_probe import probe

    for command in (demo, estimate, plan, probe):
        cli.add_command(command)


def main() -> None:
    """Run the CLI; every failure ends as one line on stderr and an exit code listed in README.md."""
    try:
        _register_commands()
        code = cli(standalone_mode=False)  # returns ctx.exit()'s code instead of exiting
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(INTERRUPTED_EXIT)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(INTERRUPTED_EXIT)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except ControllerError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # last resort: a bug, never a traceback on the operator's screen
        _report_internal_error(exc)
        sys.exit(INTERNAL_ERROR_EXIT)
    sys.exit(code if isinstance(code, int) else 0)
