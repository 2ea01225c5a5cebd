"""Run the controller's CLI the way a user does: a new Python process from the repository root, or ``main()``
in this process."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


def run_controller(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m controller ARGS`` with its output captured; a non-zero exit is returned, never raised."""
    return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout, check=False)


@dataclass(frozen=True)
class Outcome:
    """What ``controller ARGS`` printed and the exit code the shell would see."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def invoke(*args: str) -> Outcome:
    """``controller ARGS`` through the real ``main()`` in this process (so fixtures may patch it), output captured."""
    from controller.cli import main

    runner = CliRunner()
    with runner.isolation() as (stdout, stderr, _output):
        try:
            main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Outcome(code, stdout.getvalue().decode(), stderr.getvalue().decode())
