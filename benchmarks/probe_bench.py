"""Probe speed over SSH on the lab box (budget: under 3 s per probe).

    .venv/bin/python benchmarks/probe_bench.py [--runs N] [--machine FIXTURE]

Starts one systemd container, installs the stand-in nvidia-smi with a fixture machine's captures
(lab.standin_smi), then times ``probe_box`` N times: each probe opens a new SSH
connection, runs the one probe script and parses its output, as ``controller probe`` does. The
first run is reported separately: it pays for the container's first sshd session.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from controller.model.fleet import load_fleet  # noqa: E402
from controller.stages.probe.collect import probe_box  # noqa: E402
from lab import host as lab_host  # noqa: E402
from lab import image as lab_image  # noqa: E402
from lab import standin_smi  # noqa: E402
from lab import target as lab_target  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "probe"
BUDGET_S = 3.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--machine", default="twelve-v100-threadripper", help="fixture folder under tests/fixtures/probe")
    args = parser.parse_args()
    lab_host.ensure_host_ready()
    image = lab_image.ensure_image()
    with lab_target.Target.start(image=image) as box, tempfile.TemporaryDirectory(prefix="probe-bench-") as tmp:
        standin_smi.install(box, standin_smi.captures_from_dir(FIXTURES / args.machine))
        fleet = Path(tmp) / "fleet.yml"
        fleet.write_text(yaml.safe_dump({"boxes": {"bench": box.fleet_entry()}}))
        target = load_fleet(fleet).box("bench")
        first = None
        timings = []
        for index in range(args.runs + 1):
            profile, _outputs, seconds = probe_box(target)
            if index == 0:
                first = seconds
            else:
                timings.append(seconds)
    print(f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.2f}, machine: {args.machine} "
          f"({len(profile.gpus)} GPUs from the stand-in), runs: {args.runs} over SSH to {box.host}:{box.ssh_port}")
    print(f"first probe (new container): {first:.3f} s")
    print(f"median {statistics.median(timings):.3f} s, max {max(timings):.3f} s, min {min(timings):.3f} s "
          f"(budget {BUDGET_S:.0f} s)")
    if max([first or 0.0, *timings]) >= BUDGET_S:
        sys.exit(f"over budget: a probe took {max([first or 0.0, *timings]):.2f} s")


if __name__ == "__main__":
    main()
