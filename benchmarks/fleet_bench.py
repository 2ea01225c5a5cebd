"""Provisioning 1, 3 and 6 demo boxes at once, fresh and converged (targets: 6 boxes in at most 2x the time
of 1 fresh and 1.5x converged; the converged rerun of 6 under 30 s), with the per-box probe+plan cost, the memory it
takes and the CPU the controller and the boxes used.

    flock /tmp/v100-heavy.lock .venv/bin/python benchmarks/fleet_bench.py [--boxes 1 3 6]

For each fleet size: that many new systemd containers (fresh boxes; the engine pack and the image come from
the cache, built beforehand and not timed), the demo box's fleet entry for each (lab.demo.write_fleet), then
`controller provision --all --fleet FILE --json` as a user runs it (a new process: Python start, the
concurrent probe and plan, one ansible-playbook run with a fork per box, the reports), twice: fresh, then
converged. From the fleet summary: wall time, the probe+plan stage, each box's probe and plan seconds.
While a run goes, the resident memory of its processes is sampled: the controller's own and the sum over
ansible-playbook's (its main process and one fork per box). Then, in this process, the boxes are probed and
planned again under tracemalloc: the Python memory the controller holds per box (profile + plan). CPU: the
seconds used by the controller and everything it started (ansible-playbook, its forks, ssh), and how busy
the whole machine was (on this lab the boxes are containers on the same cores as the controller), and the CPU the
boxes' containers used (their cgroups); both over the cores give the least wall time a run could take on this lab.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from contextlib import ExitStack
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.actions.fleetrun import check_selection, probe_and_plan  # noqa: E402
from controller.model.fleet import load_fleet  # noqa: E402
from lab import image as lab_image  # noqa: E402
from lab import target as lab_target  # noqa: E402
from lab.demo import write_fleet  # noqa: E402
from lab.fileserver import FileServer  # noqa: E402
from lab.site import build_site  # noqa: E402
from lab.target import free_port  # noqa: E402


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``root``."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parents[int(entry.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent:
                found.append((pid, commands.get(pid, "")))
                frontier.append(pid)
    return found


class Sampler(threading.Thread):
    """Peak resident memory of the controller process and of its ansible-playbook processes, summed."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.stop, self.controller_kib, self.ansible_kib, self.ansible_procs = pid, False, 0, 0, 0
        self.control_cpu, self.machine_busy, self.box_cpu = 0.0, 0.0, 0.0

    def run(self) -> None:
        while not self.stop:
            self.controller_kib = max(self.controller_kib, rss_kib(self.pid))
            ansible = [pid for pid, command in descendants(self.pid) if "ansible-playbook" in command]
            self.ansible_kib = max(self.ansible_kib, sum(rss_kib(pid) for pid in ansible))
            self.ansible_procs = max(self.ansible_procs, len(ansible))
            time.sleep(0.5)


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU of this machine since boot (/proc/stat)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def box_cpu_seconds(names: list[str]) -> float:
    """CPU seconds the boxes' containers have used since they started (their cgroups: cgroup v1's cpuacct.usage,
    v2's cpu.stat usage_usec): what the boxes themselves ran (modules, llama-server), on this machine's cores."""
    total = 0.0
    for name in names:
        path = subprocess.run(["podman", "inspect", "--format", "{{.State.CgroupPath}}", name], capture_output=True,
                              text=True, check=True).stdout.strip()
        v1 = Path("/sys/fs/cgroup/cpuacct") / path.lstrip("/") / "cpuacct.usage"
        if v1.exists():
            total += int(v1.read_text()) / 1e9
            continue
        stat = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.stat").read_text()
        total += int(next(line.split()[1] for line in stat.splitlines() if line.startswith("usage_usec"))) / 1e6
    return total


def provision_all(fleet_path: Path, boxes: list[str]) -> tuple[float, dict, Sampler, int]:
    box_cpu0 = box_cpu_seconds(boxes)
    started = time.monotonic()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, total0 = busy_jiffies()
    process = subprocess.Popen([sys.executable, "-m", "controller", "provision", "--all", "--fleet", str(fleet_path),
                                "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(process.pid)
    sampler.start()
    out, err = process.communicate(timeout=3600)
    took = time.monotonic() - started
    busy1, total1 = busy_jiffies()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The controller, ansible-playbook, its forks and ssh: every descendant is reaped up the chain.
    sampler.control_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    sampler.machine_busy = (busy1 - busy0) / max(1, total1 - total0)
    sampler.box_cpu = box_cpu_seconds(boxes) - box_cpu0
    sampler.stop = True
    sampler.join()
    summary = next((json.loads(line) for line in out.splitlines() if line.startswith('{"type": "fleet"')), None)
    if summary is None:
        raise SystemExit(f"no fleet summary (exit {process.returncode}): {err[-2000:]}")
    return took, summary, sampler, process.returncode


def held_per_box(fleet_path: Path, inventory: Path) -> float:
    """KiB of Python memory the controller holds per box after probing and planning every box."""
    fleet = load_fleet(fleet_path)
    names = sorted(fleet.boxes)
    catalog = check_selection(fleet, names)
    probe_and_plan(fleet.boxes[names[0]], catalog, inventory)  # imports and caches first, not per box
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    kept = [probe_and_plan(fleet.boxes[name], catalog, inventory) for name in names]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    del kept
    return grown / 1024 / len(names)


def one_size(size: int, tmp: Path, site: Path, catalog: Path, image: str) -> dict:
    work = tmp / f"fleet{size}"
    work.mkdir()
    with ExitStack() as stack:
        started = time.monotonic()
        targets = [stack.enter_context(lab_target.Target.start(image=image)) for _ in range(size)]
        boot = time.monotonic() - started
        server = stack.enter_context(FileServer(site))
        fleet_path = write_fleet(work, targets, server, catalog)
        # Its own ports: a `controller demo` box of this machine may hold the demo's (the loopback is shared).
        fleet = yaml.safe_load(fleet_path.read_text())
        for box in fleet["boxes"].values():
            box["base_port"] = free_port()
        fleet_path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        names = [target.name for target in targets]
        fresh_s, fresh, fresh_mem, fresh_rc = provision_all(fleet_path, names)
        rerun_s, rerun, rerun_mem, rerun_rc = provision_all(fleet_path, names)
        held = held_per_box(fleet_path, work / "inventory")
    boxes = fresh["boxes"]
    return {
        "size": size, "boot": boot, "fresh_s": fresh_s, "fresh_rc": fresh_rc, "rerun_s": rerun_s, "rerun_rc": rerun_rc,
        "fresh_prepare": fresh["prepare_seconds"], "rerun_prepare": rerun["prepare_seconds"],
        "verified": sum(box["verified"] for box in rerun["boxes"]), "forks": fresh["forks"],
        "fresh_changed": sum(box["changed"] for box in fresh["boxes"]),
        "rerun_changed": sum(box["changed"] for box in rerun["boxes"]),
        "probe_mean": statistics.mean(box["probe_seconds"] for box in boxes + rerun["boxes"]),
        "plan_mean": statistics.mean(box["plan_seconds"] for box in boxes + rerun["boxes"]),
        "controller_mib": max(fresh_mem.controller_kib, rerun_mem.controller_kib) / 1024,
        "ansible_mib": max(fresh_mem.ansible_kib, rerun_mem.ansible_kib) / 1024,
        "ansible_procs": max(fresh_mem.ansible_procs, rerun_mem.ansible_procs),
        "held_kib_per_box": held,
        "fresh_cpu": fresh_mem.control_cpu, "rerun_cpu": rerun_mem.control_cpu,
        "fresh_busy": fresh_mem.machine_busy, "rerun_busy": rerun_mem.machine_busy,
        "fresh_box_cpu": fresh_mem.box_cpu, "rerun_box_cpu": rerun_mem.box_cpu,
        # The Ansible strategy each run went under (controller/stages/strategy.py); "-" from a controller without it.
        "fresh_strategy": (fresh.get("strategy") or {}).get("name", "-"),
        "rerun_strategy": (rerun.get("strategy") or {}).get("name", "-"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, nargs="+", default=[1, 3, 6])
    args = parser.parse_args()
    image = lab_image.ensure_image()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as name:
        tmp = Path(name)
        catalog = build_site(tmp / "site")
        for size in args.boxes:
            rows.append(one_size(size, tmp, tmp / "site", catalog, image))
            print(f"done: {size} boxes", file=sys.stderr, flush=True)
    print(f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.2f}; each size on new containers; wall times of "
          "`controller provision --all --json` (a new process)")
    print(f"{'boxes':>5} {'fresh s':>8} {'rc':>3} {'changed':>8} {'rerun s':>8} {'rc':>3} {'changed':>8} {'verified':>8} "
          f"{'prep s':>7} {'probe/box s':>11} {'plan/box s':>10} {'forks':>5}")
    for row in rows:
        print(f"{row['size']:>5} {row['fresh_s']:8.1f} {row['fresh_rc']:>3} {row['fresh_changed']:8d} "
              f"{row['rerun_s']:8.1f} {row['rerun_rc']:>3} {row['rerun_changed']:8d} {row['verified']:>8} "
              f"{row['fresh_prepare']:7.2f} {row['probe_mean']:11.3f} {row['plan_mean']:10.4f} {row['forks']:>5}")
    print(f"{'boxes':>5} {'strategy fresh':>15} {'rerun':>15}")
    for row in rows:
        print(f"{row['size']:>5} {row['fresh_strategy']:>15} {row['rerun_strategy']:>15}")
    print(f"{'boxes':>5} {'controller RSS MiB':>18} {'ansible RSS MiB':>15} {'ansible procs':>13} "
          f"{'held KiB/box':>12}")
    for row in rows:
        print(f"{row['size']:>5} {row['controller_mib']:18.1f} {row['ansible_mib']:15.1f} {row['ansible_procs']:>13} "
              f"{row['held_kib_per_box']:12.1f}")
    print(f"{'boxes':>5} {'control CPU s fresh':>19} {'rerun':>6} {'per box rerun':>13} {'machine busy fresh':>18} "
          f"{'rerun':>6}")
    for row in rows:
        print(f"{row['size']:>5} {row['fresh_cpu']:19.1f} {row['rerun_cpu']:6.1f} {row['rerun_cpu'] / row['size']:13.1f} "
              f"{row['fresh_busy']:18.0%} {row['rerun_busy']:6.0%}")
    # The boxes are containers on this machine's cores: the CPU that the controller and the boxes used together,
    # spread over every core, is the least wall time a run could take here (on a real fleet each box has its own).
    cores = os.cpu_count() or 1
    print(f"{'boxes':>5} {'box CPU s fresh':>15} {'rerun':>6} {'least wall s fresh':>18} {'rerun':>6}")
    for row in rows:
        print(f"{row['size']:>5} {row['fresh_box_cpu']:15.1f} {row['rerun_box_cpu']:6.1f} "
              f"{(row['fresh_cpu'] + row['fresh_box_cpu']) / cores:18.1f} "
              f"{(row['rerun_cpu'] + row['rerun_box_cpu']) / cores:6.1f}")
    by_size = {row["size"]: row for row in rows}
    verdicts = []
    if 1 in by_size and 6 in by_size:
        ratio = by_size[6]["fresh_s"] / by_size[1]["fresh_s"]
        verdicts.append(("6 boxes fresh <= 2x 1 box", ratio <= 2.0, f"{ratio:.2f}x"))
        ratio = by_size[6]["rerun_s"] / by_size[1]["rerun_s"]
        verdicts.append(("6 boxes converged <= 1.5x 1 box", ratio <= 1.5, f"{ratio:.2f}x"))
    if 6 in by_size:
        verdicts.append(("converged rerun of 6 < 30 s", by_size[6]["rerun_s"] < 30 and by_size[6]["rerun_changed"] == 0,
                         f"{by_size[6]['rerun_s']:.1f} s, changed={by_size[6]['rerun_changed']}"))
    for what, ok, measured in verdicts:
        print(f"{what}: {measured}: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if all(ok for _what, ok, _m in verdicts) else 1)


if __name__ == "__main__":
    main()
