"""Many boxes at once: the stages of ``provision.py``, run for a selection of the fleet.

Probing and planning are I/O bound (SSH round trips), so they run concurrently, a thread per box up to
``PROBE_WORKERS``; rendering is quick and runs box after box (a gateway box after the boxes it routes to,
whose rendered plans it reads). Then one ansible-runner run of playbooks/site.yml covers every box that
was rendered (``--limit`` names them; Ansible's own forks run them in parallel, one fork per box up to
``MAX_FORKS``), and each box gets its own report. A box that cannot be probed, planned or rendered is left
out of the run; a box that fails in the run is removed from the play by Ansible; neither stops the others.
The whole run holds the inventory lock, as one box's provision does.
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
    check_box,
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
from controller.actions.provision import add_gateway, check_driver
from controller.errors import ControllerError, LockError, PlanError, RunError
from controller.files import inventory_lock, write_atomic
from controller.model.catalog import Catalog, load_catalog
from controller.model.fleet import Box, Fleet
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan
from controller.reports.provision import build_report, not_as_asked, write_report
from controller.stages.planner import plan_box
from controller.stages.render import render_box, secrets_for
from controller.stages.runner import EventHandler, HostStats, RunInterrupted, RunResult, run_playbook
from controller.stages.transports.known_hosts import known_hosts_file
from controller.stages.verify import results

PROBE_WORKERS = 32  # boxes probed at once: each is an SSH session waiting on the box, not on this CPU
MAX_FORKS = 50  # Ansible processes at once (about 60 MB each on the controller); more boxes queue behind them

# What happened to a box, as the summary says it.
OK, FAILED, UNREACHABLE, NOT_VERIFIED, INTERRUPTED = "ok", "failed", "unreachable", "not verified", "interrupted"
NOT_AS_ASKED = "not as asked"  # verified, but serving only the wanted models that fit

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
    outcomes: list[BoxOutcome]
    elapsed: float
    prepare_seconds: float  # probe + plan of every box, concurrently, then render
    run: RunResult | None = None  # the one site.yml run (None: no box got that far)
    forks: int = 0

    @property
    def failed(self) -> list[BoxOutcome]:
        return [outcome for outcome in self.outcomes if outcome.result != OK]

    def as_dict(self) -> dict[str, Any]:
        return {
            "boxes": [outcome.as_dict() for outcome in self.outcomes],
            "failed": [outcome.box for outcome in self.failed],
            "elapsed": round(self.elapsed, 2),
            "prepare_seconds": round(self.prepare_seconds, 2),
            "forks": self.forks,
        }


@dataclass
class _Planned:
    box: Box
    profile: HardwareProfile
    plan: ServePlan
    probe_seconds: float
    plan_seconds: float


@dataclass
class _Spans:
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


def probe_and_plan(box: Box, catalog: Catalog, inventory: Path) -> _Planned:
    """Probe one box and plan its services: no change to the box and nothing written but its host key."""
    from controller.stages.probe.collect import probe_box

    profile, _raw, probe_seconds = probe_box(box, known_hosts=known_hosts_file(inventory))
    started = time.monotonic()
    check_driver(box, profile)
    plan = plan_box(box, profile, catalog)
    if not plan.services:
        reasons = "; ".join(f"{item.model}: {item.reason}" for item in plan.unplaced)
        raise PlanError(f"box {box.name}: no wanted model fits: {reasons}")
    return _Planned(box, profile, plan, probe_seconds, time.monotonic() - started)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _result_for(error: BaseException) -> str:
    from controller.errors import TransportError

    return UNREACHABLE if isinstance(error, TransportError) else FAILED


def _host_run(run: RunResult, host: str, seconds: float) -> RunResult:
    """The shared run as one host saw it: its stats and failures, successful when it failed nowhere."""
    stats = run.stats.get(host)
    failed = [task for task in run.failed if task.host == host]
    ok = stats is not None and not stats.failures and not stats.unreachable and not failed
    status = "interrupted" if run.status == "interrupted" else ("successful" if ok else "failed")
    return dataclasses.replace(run, status=status, elapsed=seconds, stats={host: stats or HostStats()},
                               failed=failed)


def provision_many(fleet: Fleet, names: Sequence[str], inventory: Path, on_event: EventHandler | None = None,
                   on_stage: StageHandler | None = None) -> FleetRun:
    """Probe and plan ``names`` concurrently, render them, run site.yml once over all of them, write each report.

    Bad input (an unknown box, group or model id) is refused before any connection. Every other problem
    stays with its box: the outcome says which and why. Ctrl-C writes each rendered box's report (where the
    run stopped), then raises RunInterrupted.
    """
    started = time.monotonic()
    stage = on_stage or (lambda box, what, detail: None)
    catalog = check_selection(fleet, names)
    outcomes = {name: BoxOutcome(name) for name in names}
    planned: dict[str, _Planned] = {}
    with inventory_lock(inventory, f"provision {len(names)} boxes"):
        for name in names:
            stage(name, "probe", "probing")

        def prepare(name: str) -> tuple[str, _Planned | BaseException]:
            try:
                return name, probe_and_plan(fleet.boxes[name], catalog, inventory)
            except ControllerError as error:
                return name, error

        with ThreadPoolExecutor(max_workers=max(1, min(PROBE_WORKERS, len(names))),
                                thread_name_prefix="probe") as pool:
            for name, got in pool.map(prepare, names):
                if isinstance(got, BaseException):
                    outcomes[name].result, outcomes[name].reason = _result_for(got), _one_line(got)
                    stage(name, outcomes[name].result, outcomes[name].reason or "")
                else:
                    planned[name] = got
                    outcomes[name].probe_seconds, outcomes[name].plan_seconds = got.probe_seconds, got.plan_seconds

        secrets: dict[str, dict[str, Any]] = {}
        # The boxes a gateway routes to are rendered first: the gateway plans over their rendered plans.
        for name in sorted(planned, key=lambda each: planned[each].box.gateway is not None):
            item = planned[name]
            try:
                add_gateway(fleet, item.box, item.plan, inventory)
                render_box(inventory, fleet, item.box, item.profile, item.plan)
                secrets[name] = secrets_for(item.box, fleet)
            except ControllerError as error:
                outcomes[name].result, outcomes[name].reason = FAILED, _one_line(error)
                stage(name, FAILED, outcomes[name].reason or "")
                del planned[name]
                continue
            services = ", ".join(f"{service.model}:{service.port}" for service in item.plan.services)
            stage(name, "planned", f"probed in {item.probe_seconds:.1f}s, planned {services}")
        prepare_seconds = time.monotonic() - started

        ready = [name for name in names if name in planned]
        run: RunResult | None = None
        forks = max(1, min(len(ready), MAX_FORKS))
        if ready:
            spans = _Spans()

            def handle(event: dict[str, Any]) -> None:
                host = (event.get("event_data") or {}).get("host")
                if host:
                    spans.seen(host)
                if on_event is not None:
                    on_event(event)

            try:
                run = run_playbook("site.yml", inventory=inventory, limit=",".join(ready), host_secrets=secrets,
                                   forks=forks, on_event=handle, raise_on_failure=False)
            except RunInterrupted as stopped:
                for name in ready:
                    _finish(planned[name], stopped.result, spans, inventory, outcomes[name])
                raise RunInterrupted(f"{stopped} (reports: {inventory / 'reports'})", stopped.result) from None
            except RunError as error:  # the run as a whole could not start or finish (a timeout, no playbook)
                for name in ready:
                    outcomes[name].result, outcomes[name].reason = FAILED, _one_line(error)
            else:
                for name in ready:
                    _finish(planned[name], run, spans, inventory, outcomes[name])
    return FleetRun([outcomes[name] for name in names], time.monotonic() - started, prepare_seconds, run,
                    forks if ready else 0)


def _finish(item: _Planned, run: RunResult, spans: _Spans, inventory: Path, outcome: BoxOutcome) -> None:
    """Write one box's report from the shared run and fill its line of the summary."""
    name = item.box.name
    seen = _host_run(run, name, spans.seconds(name))
    report = build_report(item.box, item.profile, item.plan, seen, results(run, item.box), item.probe_seconds)
    json_path, _md = write_report(inventory / "reports", report)
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


def failure_message(fleet_run: FleetRun) -> str:
    """The one line the CLI ends with when some boxes failed."""
    failed = fleet_run.failed
    named = "; ".join(f"{outcome.box}: {outcome.result}: {outcome.reason}" for outcome in failed)
    return f"{len(failed)} of {len(fleet_run.outcomes)} boxes did not provision: {named}"


# ---------------------------------------------------------------- the fleet's lock, planned afresh


def fresh_entries(fleet: Fleet, names: list[str], inventory: Path) -> dict[str, BoxLock]:
    """Probe and plan ``names`` concurrently (as provisioning would) and build their entries; the first failure
    is raised, so nothing is written from half a fleet."""
    catalog = check_selection(fleet, names)
    with ThreadPoolExecutor(max_workers=max(1, min(PROBE_WORKERS, len(names))), thread_name_prefix="lock") as pool:
        planned = list(pool.map(lambda name: probe_and_plan(fleet.boxes[name], catalog, inventory), names))
    entries = {}
    for item in planned:
        add_gateway(fleet, item.box, item.plan, inventory)  # over the rendered plans of the boxes it routes to
        entries[item.box.name] = entry_for(item.box, item.profile, item.plan)
    return entries


def _require(path: Path, fleet_path: Path) -> Lock:
    lock = read_lock(path)
    if lock is None:
        raise LockError(f"{fleet_path} has no lock ({path}): run `controller lock --fleet {fleet_path}` "
                        "(or provision without --locked) to write one")
    return lock


def check_locked(fleet: Fleet, fleet_path: Path, names: list[str], inventory: Path, path: Path | None = None,
                 ) -> Lock:
    """For ``provision --locked``: plan ``names`` afresh and refuse, before anything is rendered or run on any box,
    whatever differs from the lock."""
    path = path or lock_path(fleet_path)
    lock = _require(path, fleet_path)
    check_fleet(lock, fleet, fleet_path, path)
    for name in names:
        fleet.box(name)
        if name not in lock.boxes:
            raise LockError(f"box {name} is not in {path}: run `controller lock --fleet {fleet_path} --update` "
                            "(or provision it without --locked) to add it")
    for name, entry in fresh_entries(fleet, names, inventory).items():
        check_box(lock, name, entry, fleet_path, path)
    return lock


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
