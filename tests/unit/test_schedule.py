"""The suite's scheduling across workers (tests/plugins/schedule.py), run for real: a small suite under pytest-xdist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.plugins.schedule import ordered_units, scope_of

ROOT = Path(__file__).resolve().parents[2]
# Each test records which worker ran it, and when, into one line of the log.
RECORDING_TEST = '''
import json, os, time

def _record(name):
    with open(os.environ["SCHEDULE_LOG"], "a") as log:
        log.write(json.dumps({{"test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}}) + "\\n")

{tests}
'''


def _tests(prefix: str, count: int, sleep: float = 0.0) -> str:
    return "\n".join(f"def test_{prefix}{n}():\n    time.sleep({sleep})\n    _record('{prefix}{n}')\n"
                     for n in range(count))


def _suite(folder: Path) -> None:
    files = {
        "tests/unit/test_first.py": _tests("first", 4),
        "tests/unit/test_second.py": _tests("second", 4),
        "tests/integration/test_long.py": _tests("long", 3, 0.2),
        "tests/integration/test_molecule.py": _tests("scenario", 3, 1.0),
    }
    for name, body in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(RECORDING_TEST.format(tests=body))
    (folder / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-p tests.plugins.schedule"\n')


def _run(folder: Path, *args: str) -> list[dict]:
    log = folder / "schedule.log"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}  # this run's own
    env.update(SCHEDULE_LOG=str(log), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-loadscope-reorder",
                           *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_file_stays_on_one_worker_in_order_and_each_scenario_is_its_own_unit(tmp_path):
    _suite(tmp_path)
    runs = _run(tmp_path, "-n", "3")
    workers: dict[str, set[str]] = {}
    order: dict[str, list[str]] = {}
    for run in runs:
        name = run["test"].rstrip("0123456789")
        workers.setdefault(name, set()).add(run["worker"])
        order.setdefault(name, []).append(run["test"])
    for name in ("first", "second", "long"):
        assert len(workers[name]) == 1, (name, runs)  # one worker: module fixtures once, tests in their order
        assert order[name] == sorted(order[name]), (name, runs)
    assert len(workers["scenario"]) > 1, runs  # the molecule scenarios side by side
    assert {run["worker"] for run in runs} == {"gw0", "gw1", "gw2"}


def test_the_longest_units_come_first_and_one_process_keeps_the_order(tmp_path):
    _suite(tmp_path)
    names = [run["test"] for run in _run(tmp_path, "-n", "0")]
    assert names == ["scenario0", "long0", "long1", "long2", "scenario1", "scenario2", *(f"first{n}" for n in range(4)),
                     *(f"second{n}" for n in range(4))]


def test_a_scenario_goes_out_between_every_two_integration_files_the_longest_first():
    scenario = "tests/integration/test_molecule.py::test_molecule_scenario[{}]".format
    units = [(path, []) for path in (
        "tests/unit/test_cli.py", scenario("a"), scenario("b"), scenario("c"), "tests/integration/test_short.py",
        "tests/integration/test_seal.py", "tests/integration/test_fleet_status.py", "tests/unit/lab/test_site.py",
        "tests/integration/test_wheel.py", "tests/integration/test_lint.py")]
    order = [scope for scope, _tests in ordered_units(units)]
    assert order == [scenario("a"), "tests/integration/test_fleet_status.py", "tests/integration/test_seal.py",
                     scenario("b"), "tests/integration/test_lint.py", "tests/integration/test_wheel.py",
                     scenario("c"), "tests/integration/test_short.py",  # measured files by their time, then the rest
                     "tests/unit/test_cli.py", "tests/unit/lab/test_site.py"]


def test_the_scope_is_the_file_or_the_scenario():
    assert scope_of("tests/unit/test_cli.py::test_x[a::b]") == "tests/unit/test_cli.py"
    assert scope_of("tests/integration/test_molecule.py::test_molecule_scenario[box_seal-default]") == (
        "tests/integration/test_molecule.py::test_molecule_scenario[box_seal-default]")
