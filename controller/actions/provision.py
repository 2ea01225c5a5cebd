"""The provisioning use case: probe -> plan -> render -> run -> verify -> report, for a selection of the fleet.

``provision`` takes the names of the boxes to provision (one box is a fleet of one). It guards the fleet's lock
first (``--locked``: every box planned afresh must match its entry, or nothing is rendered or run on any box),
probes and plans the boxes concurrently, renders them (a gateway box after the boxes it routes to, whose
rendered plans it reads), runs playbooks/site.yml once over all of them (its last role runs the checks; each box
gets its own secrets), writes each box's report, and records in the fleet's lock what the boxes that ran now
have. Only the run changes the boxes. A box that cannot be probed, planned or rendered is left out of the run; a
box that fails in the run is removed from the play by Ansible; neither stops the others, unless the caller asks
for the first failure to be raised (``raise_failures``: how ``controller provision BOX`` reports one box).

One controller at a time works on an inventory folder (its mutex, ``controller.inventory``); a second one
waits. The probe checks and records SSH host keys in the inventory's ``known_hosts``, the file Ansible then
checks against. ``prepare`` (``controller render``) and ``install_driver`` (``controller driver``) use the same
stages for one box.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.actions.fleetrun import (
    FAILED,
    MAX_FORKS,
    OK,
    RAN,
    BoxOutcome,
    FleetRun,
    Planned,
    Spans,
    StageHandler,
    add_gateway,
    check_driver,
    check_selection,
    finish,
    one_line,
    plan_boxes,
    probe_and_plan,
    result_for,
)
from controller.actions.lock import check_box, entry_for, guard, lock_path, record
from controller.errors import ControllerError, RunError
from controller.inventory import Inventory
from controller.model.fleet import Fleet
from controller.reports.provision import driver_section
from controller.stages.planner import plan_driver
from controller.stages.render import render_box, secrets_for
from controller.stages.runner import EventHandler, RunInterrupted, RunResult, run_playbook
from controller.stages.strategy import Choice, choose, inputs_stamp


def _quiet(box: str, stage: str, detail: str) -> None:
    """No display: a caller from Python that wants no progress."""


FULL_RUN_VAR = "v100box_full_run"  # playbooks/site.yml: skip the converged fast path


def provision(fleet: Fleet, names: Sequence[str], inventory: Path, *, fleet_path: Path | None = None,
              locked: bool = False, raise_failures: bool = False, on_event: EventHandler | None = None,
              on_stage: StageHandler | None = None, full: bool = False) -> FleetRun:
    """Provision the boxes ``names`` and return a line per box (``FleetRun``).

    ``fleet_path``: the fleet file whose lock (``<fleet>.lock.yml`` beside it) is guarded before and recorded
    after: a lock written for another fleet file is refused before anything happens, and the boxes whose run
    finished (ok, not verified, not as asked) get their entries (None: no lock is read or written).
    ``locked``: install exactly what the lock says; each box planned afresh is compared with its entry, and the
    first difference is refused (LockError) before any box is rendered or run; nothing is recorded.
    ``raise_failures``: the first box that cannot be probed, planned, rendered or run raises its own error (a
    one-box command); otherwise each failure stays with its box. Bad input (an unknown box, model id or engine
    pack) is refused before any connection either way. On Ctrl-C each rendered box's report says where the run
    stopped, and RunInterrupted is raised. ``on_event`` gets each event of the run, ``on_stage`` each box's
    probe, plan and render news (``(box, stage, detail)``): the display is the caller's.
    ``full``: every role runs on every box, even one whose record of its last full run still matches it (the
    converged fast path of playbooks/site.yml, plugins/modules/box_manifest.py).
    """
    started = time.monotonic()
    names = list(names)
    stage = on_stage or _quiet
    if locked and fleet_path is None:
        raise ValueError("provision(locked=True) compares with a fleet's lock: give its fleet_path")
    lock = guard(fleet, fleet_path, names, locked=locked) if fleet_path is not None else None  # before any box
    catalog = check_selection(fleet, names)
    folder = Inventory(inventory)
    outcomes = {name: BoxOutcome(name) for name in names}
    reports: dict[str, dict[str, Any]] = {}
    run: RunResult | None = None
    forks = 0

    def failed(name: str, error: ControllerError) -> None:
        if raise_failures:
            raise error
        outcomes[name].result, outcomes[name].reason = result_for(error), one_line(error)
        stage(name, outcomes[name].result, outcomes[name].reason or "")

    with folder.mutex(f"provision {names[0]}" if len(names) == 1 else f"provision {len(names)} boxes"):
        for name in names:
            stage(name, "probe", "probing")
        planned: dict[str, Planned] = {}
        for name, got in plan_boxes(fleet, names, catalog, inventory).items():
            if isinstance(got, ControllerError):
                if lock is not None:  # --locked compares every box: one that cannot be planned stops them all
                    raise got
                failed(name, got)
            else:
                planned[name] = got
                outcomes[name].probe_seconds, outcomes[name].plan_seconds = got.probe_seconds, got.plan_seconds
        if lock is not None and fleet_path is not None:
            for name in names:  # a gateway over the plans rendered before this run, as `controller lock` planned it
                item = planned[name]
                add_gateway(fleet, item.box, item.plan, inventory)
                check_box(lock, name, entry_for(item.box, item.profile, item.plan), fleet_path, lock_path(fleet_path))

        secrets: dict[str, dict[str, Any]] = {}
        # The boxes a gateway routes to are rendered first: the gateway plans over their rendered plans.
        for name in sorted(planned, key=lambda each: planned[each].box.gateway is not None):
            item = planned[name]
            try:
                render(fleet, item, inventory)
                secrets[name] = secrets_for(item.box, fleet)
            except ControllerError as error:
                del planned[name]
                failed(name, error)
                continue
            services = ", ".join(f"{'+'.join(service.models or [service.model])}:{service.port}"
                                 for service in item.plan.services)
            stage(name, "planned", f"probed in {item.probe_seconds:.1f}s, planned {services}")
        prepare_seconds = time.monotonic() - started

        ready = [name for name in names if name in planned]
        choice: Choice | None = None
        if ready:
            forks = max(1, min(len(ready), MAX_FORKS))
            stamps = {name: inputs_stamp(planned[name].box, folder.host_vars_file(name), folder.known_hosts_file)
                      for name in ready}
            choice = choose([planned[name].box for name in ready], stamps, folder.last_ok_inputs(), full=full)
            folder.record_last_ok(dict.fromkeys(ready))  # a run that stops or fails leaves them forgotten
            spans = Spans()

            def handle(event: dict[str, Any]) -> None:
                host = (event.get("event_data") or {}).get("host")
                if host:
                    spans.seen(host)
                if on_event is not None:
                    on_event(event)

            def seconds(shared: RunResult, name: str) -> float:
                return shared.elapsed if len(ready) == 1 else spans.seconds(name)  # one box: the whole run is its

            try:
                run = run_playbook("site.yml", inventory=inventory, limit=",".join(ready), host_secrets=secrets,
                                   forks=forks, on_event=handle, raise_on_failure=raise_failures,
                                   extravars={FULL_RUN_VAR: True} if full else None, strategy=choice.strategy)
            except RunInterrupted as stopped:
                for name in ready:
                    reports[name] = finish(planned[name], stopped.result, seconds(stopped.result, name), inventory,
                                           outcomes[name])
                where = (f"box {ready[0]}: {stopped} (report: {outcomes[ready[0]].report})"
                         if raise_failures and len(ready) == 1 else f"{stopped} (reports: {folder.reports_folder})")
                raise RunInterrupted(where, stopped.result) from None
            except RunError as error:  # the run as a whole could not start or finish (a timeout, no playbook)
                if raise_failures:
                    raise
                for name in ready:
                    outcomes[name].result, outcomes[name].reason = FAILED, one_line(error)
            else:
                for name in ready:
                    reports[name] = finish(planned[name], run, seconds(run, name), inventory, outcomes[name])
                folder.record_last_ok({name: stamps[name] for name in ready if outcomes[name].result == OK
                                       and stamps[name] is not None})

    done = FleetRun([outcomes[name] for name in names], time.monotonic() - started, prepare_seconds, run, forks,
                    reports, strategy=choice)
    ran = [outcome.box for outcome in done.outcomes if outcome.result in RAN]
    if fleet_path is not None and lock is None and ran:  # what the boxes that ran now have
        done.lock_file = lock_path(fleet_path)
        done.lock_changes = record(done.lock_file, fleet, fleet_path, {
            name: entry_for(planned[name].box, planned[name].profile, planned[name].plan) for name in ran})
    return done


def render(fleet: Fleet, item: Planned, inventory: Path) -> None:
    """Render one planned box: its gateway over the other boxes' rendered plans, then its files."""
    add_gateway(fleet, item.box, item.plan, inventory)
    render_box(inventory, fleet, item.box, item.profile, item.plan)


def prepare(fleet: Fleet, box_name: str, inventory: Path) -> Planned:
    """Probe, plan and render one box (``controller render``); no change to the box."""
    catalog = check_selection(fleet, [box_name])
    with Inventory(inventory).mutex(f"render {box_name}"):
        item = probe_and_plan(fleet.box(box_name), catalog, inventory)
        render(fleet, item, inventory)
    return item


def install_driver(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
                   ) -> tuple[dict[str, Any], RunResult]:
    """Probe the box and run playbooks/driver.yml: only the NVIDIA driver (and NCCL where the plan wants it).

    A box that names models is planned and rendered in full, as ``provision`` would, so the inventory stays
    whole; one that names none gets only the driver role's inputs.
    """
    from controller.stages.probe.collect import probe_box  # the transports pull in fabric and pywinrm

    catalog = check_selection(fleet, [box_name])
    box = fleet.box(box_name)
    folder = Inventory(inventory)
    with folder.mutex(f"driver {box_name}"):
        if box.models:
            render(fleet, probe_and_plan(box, catalog, inventory), inventory)
        else:
            profile, _raw, _seconds = probe_box(box, known_hosts=folder.known_hosts_file)
            check_driver(box, profile)
            render_box(inventory, fleet, box, profile, None, plan_driver(box, profile, catalog))
        result = run_playbook("driver.yml", inventory=inventory, limit=box.name, secrets=secrets_for(box),
                              on_event=on_event)
    return driver_section(box, result), result
