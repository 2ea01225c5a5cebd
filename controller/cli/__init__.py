"""``controller``: probe, plan, render, provision and verify V100 LLM boxes.

One action maps to one playbook: ``provision`` runs playbooks/site.yml, ``driver`` playbooks/driver.yml,
``verify`` playbooks/verify.yml. Each command lives in its own module and only parses its arguments and
prints; ``main()`` is the one place where a failure becomes a line on stderr and an exit code.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console
from rich.markup import escape

from controller.errors import ControllerError

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE: a bug in the controller, not in its inputs
INTERRUPTED_EXIT = 130


# Each command's module, imported when the command runs (or --help lists them all): a command's start does not pay
# for the others' imports (the estimator's gguf and numpy, the clients' and the certification's modules).
COMMANDS = {
    "provision": "provision", "render": "provision", "driver": "provision", "verify": "verify", "demo": "demo",
    "estimate": "estimate", "plan": "plan", "probe": "probe", "clients": "clients", "certify": "certify",
    "lock": "lock", "status": "status", "seal": "seal",
}


class _Commands(click.Group):
    """A group whose commands are imported from ``controller.cli.<module>`` on first use (click's lazy group)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return super().get_command(ctx, cmd_name)  # one added with add_command
        return getattr(importlib.import_module(f"controller.cli.{module}"), cmd_name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="v100-llm-box")
def cli() -> None:
    """Provision Tesla V100 boxes that serve GGUF models with llama.cpp."""


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


def main(args: Sequence[str] | None = None) -> NoReturn:
    """Run the CLI; every failure ends as one line on stderr and an exit code listed in README.md."""
    try:
        code = cli(args=list(args) if args is not None else None, standalone_mode=False)  # returns ctx.exit()'s code
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
