"""A converged `controller provision` of the lab box: this tree against another checkout, on the same box.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/rerun_vs_tree.py --before /tmp/before [--runs 7]

One systemd container and one download site serve both. Both trees run under one plain virtual environment made
for the benchmark: this venv's libraries without the project's editable install, whose import hook would hand an
older checkout's Ansible plugins this tree's `controller` package. This tree provisions the box fresh; then each tree
converges it once untimed (its own inventory folder, the same box), and the timed reruns alternate, this tree
then the other, so a drift in the machine's speed moves both alike. Each run is the whole command
(`python -m controller provision demo`) from its own checkout. Prints each run, the medians, and the median of
the pairwise ratios (this tree / the other); every timed run must exit 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab import host as lab_host  # noqa: E402
from lab import image as lab_image  # noqa: E402
from lab import target as lab_target  # noqa: E402
from lab.demo import write_fleet  # noqa: E402
from lab.engine_build import build  # noqa: E402
from lab.fileserver import FileServer  # noqa: E402
from lab.site import build_site  # noqa: E402


def plain_venv(folder: Path) -> Path:
    """A virtual environment that sees this one's libraries (a .pth line) but not the project installed in it, with
    the Ansible commands started by its own interpreter; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    libraries = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "benchmark-libraries.pth").write_text(libraries + "\n")  # a path line: its own .pth files stay unread
    for script in Path(sys.executable).parent.glob("ansible*"):
        lines = script.read_text().splitlines(keepends=True)
        wrapper = folder / "bin" / script.name
        wrapper.write_text(f"#!{python}\n" + "".join(lines[1:]))
        wrapper.chmod(0o755)
    return python


def provision(python: Path, tree: Path, fleet: Path, inventory: Path) -> tuple[float, int]:
    """One whole `controller provision demo` from ``tree``'s package; wall seconds and exit code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    done = subprocess.run([str(python), "-m", "controller", "provision", "demo", "--fleet", str(fleet),
                           "--inventory", str(inventory)], cwd=tree, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        print(f"{tree}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}", file=sys.stderr)
    return seconds, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    before = args.before.resolve()
    build()  # the engine pack: cached, not timed
    lab_host.ensure_host_ready()
    image = lab_image.ensure_image()
    with tempfile.TemporaryDirectory(prefix="rerun-vs-tree-") as tmp:
        work = Path(tmp)
        python = plain_venv(work / "venv")
        catalog = build_site(work / "site")
        with lab_target.Target.start(image=image) as box, FileServer(work / "site") as server:
            fleet = write_fleet(work, box, server, catalog)
            trees = {"this": (ROOT, work / "inv-this"), "before": (before, work / "inv-before")}
            for name, (tree, inventory) in trees.items():  # fresh, then converged once: untimed
                seconds, code = provision(python, tree, fleet, inventory)
                print(f"untimed {name}: {seconds:.1f} s, exit {code}")
                if code != 0:
                    sys.exit(1)
            times: dict[str, list[float]] = {"this": [], "before": []}
            codes = []
            for index in range(args.runs):
                for name, (tree, inventory) in trees.items():
                    seconds, code = provision(python, tree, fleet, inventory)
                    times[name].append(seconds)
                    codes.append(code)
                print(f"run {index + 1}: this {times['this'][-1]:.2f} s, before {times['before'][-1]:.2f} s")
    ratios = [mine / theirs for mine, theirs in zip(times["this"], times["before"])]
    print(f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.2f}, runs: {args.runs} pairs on one box")
    print(f"median converged rerun: this tree {statistics.median(times['this']):.2f} s, "
          f"before {statistics.median(times['before']):.2f} s; median ratio this/before "
          f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    sys.exit(0 if all(code == 0 for code in codes) else 1)


if __name__ == "__main__":
    main()
