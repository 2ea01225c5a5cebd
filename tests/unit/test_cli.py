"""``main()``: every failure is one line and a documented exit code; a bug leaves its traceback in a log file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.cli import REPO, invoke
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


def _fleet(tmp_path: Path) -> Path:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("boxes:\n  box3:\n    address: 192.0.2.10\n")
    return fleet


def _provisioned(monkeypatch, report: dict) -> None:
    """The provision use case replaced: one box ran and its report says ``report``."""
    from controller.actions.fleetrun import BoxOutcome, FleetRun
    from controller.stages.runner import RunResult

    def provision(fleet, names, inventory, **kwargs):
        run = RunResult("site.yml", "successful", 0, 1.0)
        return FleetRun([BoxOutcome(names[0])], 1.0, 0.0, run, 1, {names[0]: report})

    monkeypatch.setattr("controller.actions.provision.provision", provision)


def test_an_unverified_provision_prints_the_report_then_exits_6(tmp_path, monkeypatch):
    report = {"verified": False, "services": []}
    _provisioned(monkeypatch, report)
    result = invoke("provision", "box3", "--fleet", str(_fleet(tmp_path)), "--json")
    assert result.exit_code == 6, result.output
    assert json.loads(result.stdout.splitlines()[-1]) == {"type": "report", **report}
    assert result.stderr.strip().splitlines() == ["error: box3: verification failed; the report says which server "
                                                  "answered what"]


NOT_PLACED = {"model": "qwen3.5-122b-a10b-q8_0",
              "reason": "on the CPU it needs 40960 MiB of RAM at 4096 tokens of context, against 7000 MiB free"}


def _partly_placed(monkeypatch, verified: bool = True) -> dict:
    report = {"box": "box3", "address": "192.0.2.10", "generated": "2026-11-24T03:00:00+00:00",
              "hardware": {"gpus": [], "driver": None, "cpu": "x", "cores": 2, "memory_mib": 8192, "os": "Debian 12",
                           "warnings": [], "probe_seconds": 0.5},
              "run": None, "driver": {}, "cache": None, "services": [], "unplaced": [NOT_PLACED],
              "verified": verified, "provisioned_as_asked": False}
    _provisioned(monkeypatch, report)
    return report


def test_a_provision_that_left_a_wanted_model_unplaced_exits_4_naming_it_last(tmp_path, monkeypatch):
    """Issue 21: provision exited 0 and printed "Verified: yes" with the unplaced model on line 207 of 211."""
    report = _partly_placed(monkeypatch)
    result = invoke("provision", "box3", "--fleet", str(_fleet(tmp_path)), "--json")
    assert result.exit_code == 4, result.output
    last = json.loads(result.stdout.splitlines()[-1])
    assert last == {"type": "report", **report} and last["unplaced"] == [NOT_PLACED]
    assert last["provisioned_as_asked"] is False
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: box3 is not provisioned as asked: qwen3.5-122b-a10b-q8_0 was not placed: on the CPU")
    assert "7000 MiB free" in line

    text = invoke("provision", "box3", "--fleet", str(_fleet(tmp_path)))
    assert text.exit_code == 4
    shown = [line for line in text.stdout.splitlines() if line.strip()]
    assert shown[-1].startswith("- Not placed: qwen3.5-122b-a10b-q8_0: on the CPU it needs 40960 MiB")
    assert "Provisioned as asked: **NO**" in text.stdout


def test_a_failed_verification_outranks_an_unplaced_model_and_both_are_named(tmp_path, monkeypatch):
    _partly_placed(monkeypatch, verified=False)
    result = invoke("provision", "box3", "--fleet", str(_fleet(tmp_path)), "--json")
    assert result.exit_code == 6, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "verification failed" in line and "qwen3.5-122b-a10b-q8_0 was not placed" in line


def test_verify_without_a_rendered_inventory_is_one_line_and_exit_1(tmp_path):
    result = invoke("verify", "box3", "--fleet", str(_fleet(tmp_path)))
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "has no rendered inventory for box3" in line and "controller render box3" in line


def test_demo_from_an_install_without_the_clone_says_so_in_one_line(tmp_path):
    """An installed package (here: a copy of controller/ alone) has no lab/ beside it."""
    shutil.copytree(REPO / "controller", tmp_path / "site" / "controller",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    done = subprocess.run([sys.executable, "-m", "controller", "demo"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=60, check=False)
    assert_one_line_error(done, 2, "controller demo runs from a clone", "no lab/ beside it")


def test_each_command_imports_its_own_module_only():
    # Every command is found by its name, and --help lists them all; running one imports its module and what that
    # needs, not the others' (status does not pay for the estimator's gguf and numpy, nor for certify's modules).
    from controller.cli import COMMANDS, cli

    assert {name: cli.get_command(None, name).name for name in COMMANDS} == {name: name for name in COMMANDS}
    listed = subprocess.run([sys.executable, "-m", "controller", "--help"], capture_output=True, text=True, cwd=REPO,
                            check=True).stdout
    assert all(f"  {name} " in listed for name in COMMANDS), listed
    code = ("import sys\nfrom controller.cli import main\ntry:\n    main(['status', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(name for name in ('controller.cli.estimate', 'controller.cli.certify', 'gguf', "
            "'numpy', 'controller.cli.status') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip().splitlines()[-1] == "['controller.cli.status']", done.stdout
