"""Many boxes at once: the pieces the provision use case (``controller.actions.provision``) and ``controller lock``
share.

Probing and planning are I/O bound (SSH round trips), so ``plan_boxes`` runs them concurrently, a thread per box up
to ``PROBE_WORKERS``, and gives each box its plan or its error. A gateway is planned over the rendered plans of the
boxes it routes to (``add_gateway``). One run of playbooks/site.yml covers every box (Ansible's forks, one per box up
to ``MAX_FORKS``); ``finish`` reads one box's part of it (``host_run``) into the box's report and its line of the
summary (``BoxOutcome``; ``FleetRun`` is the whole). ``lock_fleet`` is ``controller lock``: the boxes planned
afresh, their entries written into the fleet's lock or compared with it; nothing is rendered.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.actions.lock import (
    BoxLock,
    Lock,
    changes,
    check_fleet,
    check_fleet_file,
    differences,
    dumps,
    entry_for,
    held,
    lock_path,
    read_lock,
    updated,
)
from controller.errors import ControllerError, PlanError, TransportError
from controller.files import write_atomic
from controller.inventory import Inventory
from controller.model.catalog import Catalog, load_catalog
from controller.model.fleet import Box, Fleet
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan
from controller.reports.provision import build_report, not_as_asked, write_report
from controller.stages.planner import plan_box
from controller.stages.planner.gateway import plan_gateway
from controller.stages.probe.driver import driver_window_problem
from controller.stages.runner import HostStats, RunResult
from controller.stages.strategy import Choice
from controller.stages.verify import results

PROBE_WORKERS = 32  # boxes probed at once: each is an SSH session waiting on the box, not on this CPU
MAX_FORKS = 50  # Ansible processes at once (about 60 MB each on the controller); more boxes queue behind them

# What happened to a box, as the summary says it.
OK, FAILED, UNREACHABLE, NOT_VERIFIED, INTERRUPTED = "ok", "failed", "unreachable", "not verified", "interrupted"
NOT_AS_ASKED = "not as asked"  # verified, but serving only the wanted models that fit
RAN = (OK, NOT_VERIFIED, NOT_AS_ASKED)  # the run finished on the box: what it now has is what was rendered

StageHandler = Callable[[str, str, str], None]  # (box, stage, detail): probe/plan/render progress for the display


@dataclass
class BoxOutcome:
    """One box's line of the summary (``as_dict`` is the ``--json`` contract: extend, never rename)."""

    box: str
    result: str = FAILED
    reason: str | None = None  # why, for every result but ok
    changed: int = 0
    seconds: float = 0.0  # probe + plan + this box's part of the run
    verified: bool = False
    probe_seconds: float = 0.0
    plan_seconds: float = 0.0
    report: str | None = None  # the report's JSON file, once written
    unplaced: list[dict[str, Any]] = field(default_factory=list)  # the report's: each wanted model not placed, and why
    provisioned_as_asked: bool = False  # the report's: every wanted model placed (False until a report says so)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key, digits in (("seconds", 2), ("probe_seconds", 3), ("plan_seconds", 4)):
            out[key] = round(out[key], digits)
        return out


@dataclass
class FleetRun:
    """What a provision did: a line per box, the one run, and what it recorded in the fleet's lock."""

    outcomes: list[BoxOutcome]
    elapsed: float
    prepare_seconds: float  # probe + plan of every box, concurrently, then render
    run: RunResult | None = None  # the one site.yml run (None: no box got that far)
    forks: int = 0
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # each written report, by box
    lock_file: Path | None = None  # the fleet's lock, when the boxes that ran were recorded in it
    lock_changes: list[str] | None = None  # what recording changed there (None: nothing was recorded)
    strategy: Choice | None = None  # the Ansible strategy of the run and why (None: no run)

    @property
    def failed(self) -> list[BoxOutcome]:
        return [outcome for outcome in self.outcomes if outcome.result != OK]

    def as_dict(self) -> dict[str, Any]:
        return {
            "boxes": [outcome.as_dict() for outcome in self.outcomes],
            "failed": [outcome.box for outcome in self.failed],
            "elapsed": round(self.elapsed, 2),
            "prepare_seconds": round(self.prepare_seconds, 2),
            "run_seconds": round(self.run.elapsed, 2) if self.run is not None else None,  # the site.yml run
            "forks": self.forks,
            "strategy": self.strategy.as_dict() if self.strategy is not None else None,
        }


@dataclass
class Planned:
    """A box probed and planned, nothing rendered yet."""

    box: Box
    profile: HardwareProfile
    plan: ServePlan
    probe_seconds: float
    plan_seconds: float


@dataclass
class Spans:
    """When each host's first and last run event came (monotonic): its part of the shared run."""

    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def seen(self, host: str) -> None:
        now = time.monotonic()
        self.first.setdefault(host, now)
        self.last[host] = now

    def seconds(self, host: str) -> float:
        return self.last.get(host, 0.0) - self.first.get(host, 0.0)


def check_selection(fleet: Fleet, names: Sequence[str]) -> Catalog:
    """Refuse, before any connection, a box whose models or engine packs the catalog lacks (bad input stops all)."""
    catalog = load_catalog(fleet.catalogs)
    for name in names:
        box = fleet.box(name)
        fleet.check_models_known(box, catalog.models)
        for wanted in box.models:
            if wanted.engine is not None:
                catalog.engine(wanted.engine)
    return catalog


def check_driver(box: Box, profile: HardwareProfile) -> None:
    """Refuse a V100 box whose installed driver is outside the driver window (controller.model.rules); name the
    one to install.

    No driver at all is fine: the driver role installs one. A driver in the window is kept as it is.
    """
    if not any(gpu.is_v100 for gpu in profile.gpus) or not profile.driver.version:
        return
    problem = driver_window_problem(profile.driver.version, has_volta=True, os_family=profile.os.family or box.os,
                                    wsl=profile.os.wsl)
    if problem:
        raise PlanError(f"box {box.name}: {problem}; then provision again")


def probe_and_plan(box: Box, catalog: Catalog, inventory: Path) -> Planned:
    """Probe one box and plan its services: no change to the box and nothing written but its host key."""
    from controller.stages.probe.collect import probe_box  # the transports pull in fabric and pywinrm

    profile, _raw, probe_seconds = probe_box(box, known_hosts=Inventory(inventory).known_hosts_file)
    started = time.monotonic()
    check_driver(box, profile)
    plan = plan_box(box, profile, catalog)
    if not plan.services:
        reasons = "; ".join(f"{item.model}: {item.reason}" for item in plan.unplaced)
        raise PlanError(f"box {box.name}: no wanted model fits: {reasons}")
    return Planned(box, profile, plan, probe_seconds, time.monotonic() - started)


def plan_boxes(fleet: Fleet, names: Sequence[str], catalog: Catalog, inventory: Path,
               ) -> dict[str, Planned | ControllerError]:
    """Probe and plan ``names`` concurrently; each box's plan, or the error that stopped it, in the order given."""

    def one(name: str) -> Planned | ControllerError:
        try:
            return probe_and_plan(fleet.boxes[name], catalog, inventory)
        except ControllerError as error:
            return error

    with ThreadPoolExecutor(max_workers=max(1, min(PROBE_WORKERS, len(names))), thread_name_prefix="probe") as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def add_gateway(fleet: Fleet, box: Box, plan: ServePlan, inventory: Path) -> None:
    """Plan the box's gateway (when the fleet gives it one) over the plans rendered for the boxes it routes to."""
    if box.gateway is not None:
        folder = Inventory(inventory)
        plan.gateway = plan_gateway(box, plan, {name: (fleet.box(name), folder.find_plan(name))
                                                for name in box.gateway.boxes if name != box.name})


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def result_for(error: BaseException) -> str:
    return UNREACHABLE if isinstance(error, TransportError) else FAILED


def host_run(run: RunResult, host: str, seconds: float) -> RunResult:
    """The shared run as one host saw it: its stats and failures, successful when it failed nowhere."""
    stats = run.stats.get(host)
    failed = [task for task in run.failed if task.host == host]
    ok = stats is not None and not stats.failures and not stats.unreachable and not failed
    status = "interrupted" if run.status == "interrupted" else ("successful" if ok else "failed")
    return dataclasses.replace(run, status=status, elapsed=seconds, stats={host: stats or HostStats()},
                               failed=failed)


def finish(item: Planned, run: RunResult, seconds: float, inventory: Path, outcome: BoxOutcome) -> dict[str, Any]:
    """Write one box's report from the shared run (``seconds``: its part of it) and fill its line of the summary;
    returns the report."""
    name = item.box.name
    seen = host_run(run, name, seconds)
    report = build_report(item.box, item.profile, item.plan, seen, results(run, item.box), item.probe_seconds)
    json_path, _md = write_report(Inventory(inventory), report)
    stats = seen.stats[name]
    outcome.changed, outcome.verified, outcome.report = stats.changed, bool(report["verified"]), str(json_path)
    outcome.unplaced, outcome.provisioned_as_asked = list(report["unplaced"]), bool(report["provisioned_as_asked"])
    outcome.seconds = item.probe_seconds + item.plan_seconds + seen.elapsed
    mine = seen.failed
    if run.status == "interrupted":
        outcome.result, outcome.reason = INTERRUPTED, f"stopped during {run.last_task or 'the first task'}"
    elif stats.unreachable or any(task.unreachable for task in mine):
        outcome.result = UNREACHABLE
        outcome.reason = f"unreachable from Ansible: {mine[0].message}" if mine else "unreachable from Ansible"
    elif stats.failures or mine:
        outcome.result = FAILED
        outcome.reason = f"task '{mine[0].task}' failed: {mine[0].message}" if mine else "a task failed"
    elif name not in run.stats:
        outcome.result, outcome.reason = FAILED, "the run never reached this box"
    elif not outcome.verified:
        unverified = [service["name"] for service in report["services"] if not service["verified"]]
        outcome.result = NOT_VERIFIED
        outcome.reason = f"verification failed for {', '.join(unverified) or 'the box'}; see {json_path}"
    elif missing := not_as_asked(report):
        outcome.result, outcome.reason = NOT_AS_ASKED, missing
    else:
        outcome.result, outcome.reason = OK, None
    return report


def failure_message(fleet_run: FleetRun) -> str:
    """The one line the CLI ends with when some boxes failed."""
    failed = fleet_run.failed
    named = "; ".join(f"{outcome.box}: {outcome.result}: {outcome.reason}" for outcome in failed)
    return f"{len(failed)} of {len(fleet_run.outcomes)} boxes did not provision: {named}"


# ---------------------------------------------------------------- `controller lock`: the boxes planned afresh


def fresh_entries(fleet: Fleet, names: list[str], inventory: Path) -> dict[str, BoxLock]:
    """Probe and plan ``names`` concurrently (as provisioning would) and build their entries; the first failure
    is raised, so nothing is written from half a fleet."""
    planned = plan_boxes(fleet, names, check_selection(fleet, names), inventory)
    entries = {}
    for name, item in planned.items():
        if isinstance(item, ControllerError):
            raise item
        add_gateway(fleet, item.box, item.plan, inventory)  # over the rendered plans of the boxes it routes to
        entries[name] = entry_for(item.box, item.profile, item.plan)
    return entries


@dataclass
class LockOutcome:
    path: Path
    lock: Lock
    written: bool
    changes: list[str]  # what the update changed, or (without --update) how the fleet now differs


def lock_fleet(fleet: Fleet, fleet_path: Path, inventory: Path, names: list[str] | None = None,
               update: bool = False, path: Path | None = None) -> LockOutcome:
    """``controller lock``: write the lock when there is none; with ``update``, refresh ``names`` (default: every
    box) and drop the boxes the fleet no longer names; without it, compare and write nothing."""
    path = path or lock_path(fleet_path)
    names = list(names) if names else sorted(fleet.boxes)
    for name in names:
        fleet.box(name)
    existing = read_lock(path)
    if existing is not None and not update:
        check_fleet(existing, fleet, fleet_path, path)
        fresh = fresh_entries(fleet, names, inventory)
        found = [f"{name}: not in the lock" for name in names if name not in existing.boxes]
        found += [f"{name}: {line}" for name in names if name in existing.boxes
                  for line in differences(existing.boxes[name], fresh[name])]
        return LockOutcome(path, existing, False, found)
    if existing is not None:
        check_fleet_file(existing, fleet, fleet_path, path)
    fresh = fresh_entries(fleet, names, inventory)
    with held(fleet_path):
        old = read_lock(path)
        new = updated(old, fleet, fleet_path, fresh)
        written = old is None or dumps(new) != dumps(old)
        if written:
            write_atomic(path, dumps(new))
    return LockOutcome(path, new, written, changes(old, new))
