"""The fast loop's targets, as ratios measured in one run: a converged `controller provision BOX` against
`controller status BOX` on the same box (target: at most 1.5x), and six converged boxes against one (at most
1.5x); with `--full`, the full (every role) converged rerun beside them, what the fast path saves.

    flock /tmp/v100-heavy.lock .venv/bin/python benchmarks/converged_bench.py [--boxes 6] [--runs 5] [--full]

Starts that many systemd containers of its own (other names and ports than any `controller demo` box), provisions
them at once (fresh, `provision --all`, timed once) and converges them once untimed (each box's record of its
last full run is then in place). Then each round runs, as a user does (a new process each: Python start, probe,
plan, render, one ansible-playbook run, the report), in this order: status of box 1, provision of box 1, status
of every box, provision of every box (and with `--full` provision --full of box 1); alternating them lets a drift
in the machine's speed move all alike. Every timed run must exit 0 and every provision must take the fast path
(its `fast_path` event says converged). Prints each round, the medians and the medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.status_bench import controller, lab_fleet  # noqa: E402

STAGES: dict[str, list[tuple[float, float]]] = {}  # label -> (probe [+plan+render for a fleet], site.yml run)


def timed(label: str, *args: str, converged: int | None = None) -> float:
    took, done = controller(*args)
    for line in done.stdout.splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("type") == "fleet" and event.get("run_seconds") is not None:
            STAGES.setdefault(label, []).append((event["prepare_seconds"], event["run_seconds"]))
        elif event.get("type") == "report":
            STAGES.setdefault(label, []).append(((event.get("hardware") or {}).get("probe_seconds", 0),
                                                 (event.get("run") or {}).get("elapsed", 0)))
    if done.returncode != 0:
        raise SystemExit(f"{label}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    if converged is not None:
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        fast = [event for event in events if event.get("type") == "fast_path" and event["converged"]]
        if len(fast) != converged:
            raise SystemExit(f"{label}: {len(fast)} of {converged} boxes took the fast path: "
                             f"{[event for event in events if event.get('type') == 'fast_path']}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, default=6)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="also time provision --full of box 1 each round")
    args = parser.parse_args()
    with lab_fleet(args.boxes, "converged-bench-") as (fleet_path, names):
        fleet_arg = ("--fleet", str(fleet_path), "--json")
        took = timed("fresh provision --all", "provision", "--all", *fleet_arg)
        print(f"setup: fresh provision --all of {args.boxes} boxes: {took:.1f} s")
        timed("first converge", "provision", "--all", *fleet_arg)  # the records of a full run are in place
        columns = ["status 1", "provision 1", f"status {args.boxes}", f"provision {args.boxes}"]
        if args.full:
            columns.append("provision --full 1")
        print("round  " + "  ".join(f"{column:>18}" for column in columns))
        rows = []
        for round_number in range(1, args.runs + 1):
            row = [timed("status 1", "status", names[0], *fleet_arg),
                   timed("provision 1", "provision", names[0], *fleet_arg, converged=1),
                   timed("status all", "status", *names, *fleet_arg),
                   timed("provision all", "provision", "--all", *fleet_arg, converged=len(names))]
            if args.full:
                row.append(timed("provision --full 1", "provision", names[0], "--full", *fleet_arg, converged=0))
            rows.append(row)
            print(f"{round_number:>5}  " + "  ".join(f"{value:>17.2f}s" for value in row))
        medians = [statistics.median(column) for column in zip(*rows)]
        print("median " + "  ".join(f"{value:>17.2f}s" for value in medians))
        ratios = {
            "converged provision 1 / status 1 (target <= 1.5)": [r[1] / r[0] for r in rows],
            f"converged provision {args.boxes} / provision 1 (target <= 1.5)": [r[3] / r[1] for r in rows],
            f"converged provision {args.boxes} / status {args.boxes}": [r[3] / r[2] for r in rows],
        }
        if args.full:
            ratios["provision --full 1 / converged provision 1"] = [r[4] / r[1] for r in rows]
        for label, values in ratios.items():
            print(f"{label}: median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})")
        for label, stages in STAGES.items():
            prepare, run = zip(*stages)
            print(f"{label}: probe (a fleet: probe, plan, render) median {statistics.median(prepare):.2f}s, site.yml run median "
                  f"{statistics.median(run):.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
