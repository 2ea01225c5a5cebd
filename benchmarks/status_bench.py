"""`controller status` wall time for 1, 3 and 6 lab boxes (target: 6 boxes under 5 s).

    flock /tmp/v100-heavy.lock .venv/bin/python benchmarks/status_bench.py [--boxes 1 3 6] [--runs 3]

Starts the largest number of systemd containers asked for (its own, beside any `controller demo` boxes:
other names, other ports), provisions them at once with `controller provision --all` (not timed as part of
status), then times `controller status BOX... --json` as a user runs it (a new process each time: Python
start, one ansible-playbook run over the boxes, the comparison), for the first 1, 3, 6 boxes. The first
status of a size opens the SSH connections; the others reuse them (ControlPersist), as a user's second
status within a minute does. Both are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab import image as lab_image  # noqa: E402
from lab import target as lab_target  # noqa: E402
from lab.demo import write_fleet  # noqa: E402
from lab.fileserver import FileServer  # noqa: E402
from lab.site import build_site  # noqa: E402
from lab.target import free_port  # noqa: E402
from tests.cli import run_controller  # noqa: E402


def controller(*args: str, timeout: float = 1800) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = run_controller(*args, timeout=timeout)
    return time.monotonic() - started, done


@contextmanager
def lab_fleet(count: int, prefix: str) -> Iterator[tuple[Path, list[str]]]:
    """``count`` new systemd containers of the benchmark's own (other names and ports than any `controller demo`
    box) with the lab site served, and their fleet file; yields it and the boxes' names, removes them after."""
    image = lab_image.ensure_image()
    with tempfile.TemporaryDirectory(prefix=prefix) as work_dir, ExitStack() as stack:
        work = Path(work_dir)
        catalog = build_site(work / "site")
        targets = [stack.enter_context(lab_target.Target.start(image=image)) for _ in range(count)]
        server = stack.enter_context(FileServer(work / "site"))
        fleet_path = write_fleet(work, targets, server, catalog)
        fleet = yaml.safe_load(fleet_path.read_text())
        for box in fleet["boxes"].values():  # away from the ports of any `controller demo` boxes
            box["base_port"] = free_port()
        fleet_path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        yield fleet_path, list(fleet["boxes"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, nargs="+", default=[1, 3, 6])
    parser.add_argument("--runs", type=int, default=3, help="status runs per size after the first")
    args = parser.parse_args()
    most = max(args.boxes)
    with lab_fleet(most, "status-bench-") as (fleet_path, names):
        took, done = controller("provision", "--all", "--fleet", str(fleet_path), "--json")
        print(f"setup: provision --all of {most} boxes: {took:.1f} s, exit {done.returncode}")
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            return 1
        print(f"{'boxes':>5}  {'first s':>8}  {'median s':>8}  {'min s':>6}  {'max s':>6}  exit  per box s")
        for size in sorted(args.boxes):
            chosen = names[:size]
            first, done = controller("status", *chosen, "--fleet", str(fleet_path), "--json")
            times = []
            for _ in range(args.runs):
                took, done = controller("status", *chosen, "--fleet", str(fleet_path), "--json")
                times.append(took)
            answer = json.loads(done.stdout)
            assert [box["name"] for box in answer["boxes"]] == chosen, done.stdout
            median = statistics.median(times)
            print(f"{size:>5}  {first:>8.2f}  {median:>8.2f}  {min(times):>6.2f}  {max(times):>6.2f}  "
                  f"{done.returncode:>4}  {median / size:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
