"""Provisioning speed on the lab box: a fresh provision (the one-off engine build excluded) and an
idempotent rerun (target: under 20 s with changed=0).

    .venv/bin/python benchmarks/provision_bench.py [--runs N]

Each run starts a new systemd container, so "fresh" really is fresh; the engine pack and the image
come from the cache, built beforehand and not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.actions.provision import provision
from controller.model.fleet import load_fleet
from lab import image as lab_image
from lab import target as lab_target
from lab.demo import write_fleet
from lab.fileserver import FileServer
from lab.site import build_site


def one_run(work: Path, site: Path, catalog: Path, image: str) -> tuple[float, int, float, int, bool]:
    with lab_target.Target.start(image=image) as box, FileServer(site) as server:
        fleet_path = write_fleet(work, box, server, catalog)
        inventory = work / "inventory"
        started = time.monotonic()
        fresh = provision(load_fleet(fleet_path), ["demo"], inventory, raise_failures=True)
        fresh_s = time.monotonic() - started
        started = time.monotonic()
        rerun = provision(load_fleet(fleet_path), ["demo"], inventory, raise_failures=True)
        rerun_s = time.monotonic() - started
    return fresh_s, fresh.run.changed, rerun_s, rerun.run.changed, rerun.reports["demo"]["verified"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    image = lab_image.ensure_image()
    rows = []
    with tempfile.TemporaryDirectory(prefix="provision-bench-") as tmp:
        catalog = build_site(Path(tmp) / "site")
        for index in range(args.runs):
            work = Path(tmp) / f"run{index}"
            work.mkdir()
            rows.append(one_run(work, Path(tmp) / "site", catalog, image))
    print(f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.2f}, runs: {args.runs} (each on a new container)")
    print(f"{'run':>4} {'fresh s':>8} {'changed':>8} {'rerun s':>8} {'changed':>8} verified")
    for index, (fresh_s, fresh_changed, rerun_s, rerun_changed, verified) in enumerate(rows, 1):
        print(f"{index:>4} {fresh_s:8.1f} {fresh_changed:8d} {rerun_s:8.1f} {rerun_changed:8d} {verified}")
    rerun_median = statistics.median(row[2] for row in rows)
    ok = rerun_median < 20 and all(row[3] == 0 for row in rows)
    print(f"median fresh {statistics.median(row[0] for row in rows):.1f} s, median rerun {rerun_median:.1f} s "
          f"(target < 20 s, changed=0): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
