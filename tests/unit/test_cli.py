"""``main()``: every failure is one line and a documented exit code; a bug leaves its traceback in a log file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cli import REPO
from tests.unit.clean_errors import assert_one_line_error

# A command with a bug in it, added to the real CLI group, run through the real main().
CRASHING_COMMAND = """
import sys, click
from controller import cli

@click.command("crash")
def crash():
    {}["missing"]

cli.cli.add_command(crash)
sys.argv = ["controller", "crash"]
cli.main()
"""


def _crash(state_home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, XDG_STATE_HOME=str(state_home))
    return subprocess.run([sys.executable, "-c", CRASHING_COMMAND], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=60, check=False)


def test_an_unexpected_error_is_one_line_and_the_traceback_goes_to_a_log(tmp_path):
    line = assert_one_line_error(_crash(tmp_path), 70, "internal error: KeyError: 'missing'", "a bug in the controller")
    (log,) = (tmp_path / "v100-llm-box" / "logs").iterdir()
    assert str(log) in line
    text = log.read_text()
    assert text.startswith("controller crash\n") and "Traceback" in text and "KeyError: 'missing'" in text


def test_a_log_folder_that_cannot_be_written_still_gives_one_line(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    assert_one_line_error(_crash(blocker), 70, "internal error: KeyError", "could not be saved")
