"""``controller status``: what each box runs, compared with its plan and the fleet's lock. Read-only.

``run_status`` runs playbooks/status.yml once over every selected box (Ansible's forks read the boxes at the
same time; a box that does not answer is ``reachable: false`` and the others go on). The play reads, in check
mode, through ``llama_box_state`` (units, model files beside their install records, engine links, GPUs), the
llama_service templates in check mode (would provision rewrite a unit?) and ``llama_api_check`` without chat
turns; ``roles/llama_verify/tasks/status.yml`` publishes that under ``llama_status``.

``box_status`` (pure) turns one box's answers, its rendered plan and its lock entry into services and drift,
each drift with the command that brings the box back. Model files are never hashed: ``gguf_download`` wrote a
``<file>.verified`` record (sha256, size, mtime, inode, owner) after it checked the file at install, and a file
that no longer matches its record was replaced or rewritten; the record's sha256 is compared with the plan and
the lock. The JSON contract: ``{boxes: [{name, reachable, services: [{model, port, active, healthy,
served_model}], drift: [{what, detail, fix}]}]}``, extended (never renamed) with the fields below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from controller.errors import NotRendered
from controller.inventory import Inventory, handed_over, role_engine_roots
from controller.model.fleet import Box, Fleet
from controller.model.rules import DEFAULT_MODEL_DIR
from controller.model.serveplan import ServePlan
from controller.stages.runner import EventHandler, RunResult, run_playbook

PLAYBOOK = "status.yml"
STATS_KEY = "llama_status"  # the set_stats key of roles/llama_verify tasks/status.yml

# Exit codes of `controller status` (README): the first that applies.
EXIT_OK = 0
EXIT_UNREACHABLE = 3  # a box did not answer (or was never provisioned from this inventory)
EXIT_UNHEALTHY = 6  # a planned server is not running or not healthy
EXIT_DRIFT = 9  # every server answers, but a box differs from its plan or its lock
MAX_FORKS = 50  # boxes read at once


@dataclass(frozen=True)
class Drift:
    what: str  # a stable name: service-stopped, unit-edited, model-replaced, engine-switched, ...
    detail: str
    fix: str


@dataclass(frozen=True)
class ServiceStatus:
    model: str
    port: int
    active: bool
    healthy: bool
    served_model: str | None
    name: str = ""  # the unit
    state: str = ""  # systemd's ActiveState/SubState, e.g. "active/running", "failed/failed"
    enabled: str = ""  # systemd's UnitFileState
    engine: str = ""  # the engine slot and the version its current link points at, e.g. "cpu 0c1e570"
    error: str = ""  # why it is not healthy
    models: list[str] = field(default_factory=list)  # every model it answers (an on-demand router's several)
    loaded: list[str] | None = None  # an on-demand router: the models loaded now; None for an ordinary server


@dataclass
class BoxStatus:
    name: str
    reachable: bool
    services: list[ServiceStatus] = field(default_factory=list)
    drift: list[Drift] = field(default_factory=list)
    error: str = ""  # why the box could not be read
    engines: list[dict[str, Any]] = field(default_factory=list)  # {slot, planned, running, locked}
    models: list[dict[str, Any]] = field(default_factory=list)  # {file, size_bytes, sha256, recorded, locked, ok}
    gpus: list[dict[str, Any]] = field(default_factory=list)  # nvidia-smi's fields + memory_planned_mib
    gpu_error: str = ""
    locked: bool = False  # the fleet's lock has an entry for this box (and it was compared)
    sealed: str = ""  # when this inventory sealed the box: handed over, not read (the builder's keys no longer open it)

    @property
    def healthy(self) -> bool:
        return self.reachable and not self.error and all(s.active and s.healthy for s in self.services)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["healthy"] = self.healthy
        return data


def exit_code(boxes: Sequence[BoxStatus]) -> int:
    boxes = [box for box in boxes if not box.sealed]  # handed over: not the builder's to watch any more
    if any(not box.reachable for box in boxes):
        return EXIT_UNREACHABLE
    if any(not box.healthy for box in boxes):
        return EXIT_UNHEALTHY
    if any(box.drift for box in boxes):
        return EXIT_DRIFT
    return EXIT_OK


def to_json(boxes: Sequence[BoxStatus]) -> dict[str, Any]:
    return {"boxes": [box.to_json() for box in boxes], "exit_code": exit_code(boxes)}


def _provision(box: str, fleet_path: str) -> str:
    return f"controller provision {box} --fleet {fleet_path}"


def _edited(answers: Mapping[str, Any], suffix: str) -> bool | None:
    """Whether the box's file (the one whose path ends with ``suffix``) differs from what llama_service renders;
    None when the play did not say."""
    expected = answers.get("expected_checksums") or {}
    found = answers.get("checksums") or {}
    paths = [path for path in expected if path.endswith(suffix)]
    if not paths:
        return None
    return any(found.get(path) != expected[path] for path in paths)


def _unit_drift(name: str, unit: Mapping[str, Any], unit_file_changed: bool | None, env_changed: bool | None,
                provision: str) -> list[Drift]:
    found: list[Drift] = []
    if unit.get("load") not in (None, "loaded"):
        return [Drift("service-missing", f"{name}.service is {unit.get('load') or 'unknown'} to systemd",
                      f"{provision} (writes the unit from the plan and starts it)")]
    if unit_file_changed:
        found.append(Drift("unit-edited", f"{unit.get('fragment') or name + '.service'} differs from the unit the "
                           "plan renders (edited by hand?)",
                           f"{provision} (rewrites the unit from the plan and restarts the server)"))
    if env_changed:
        found.append(Drift("env-edited", f"the environment file of {name} differs from the plan's",
                           f"{provision} (rewrites it and restarts the server)"))
    if unit.get("drop_ins"):
        paths = " ".join(unit["drop_ins"])
        found.append(Drift("unit-drop-in", f"{name}.service is changed by drop-ins: {paths}",
                           f"remove them on the box (`systemctl revert {name}.service`), then {provision}"))
    if unit.get("need_reload") and not unit_file_changed:
        found.append(Drift("unit-not-reloaded", f"systemd runs an older copy of {name}.service than the file on disk",
                           f"`systemctl daemon-reload` and `systemctl restart {name}` on the box, or {provision}"))
    if unit.get("active") != "active":
        found.append(Drift("service-stopped", f"{name} is {unit.get('active')} ({unit.get('sub')})",
                           f"{provision} (starts it; `journalctl -u {name}` on the box says why it stopped)"))
    if unit.get("enabled") not in ("enabled", None):
        found.append(Drift("service-disabled", f"{name} is {unit.get('enabled')}: it will not start at boot",
                           f"{provision} (enables it)"))
    return found


def _model_drift(plan: ServePlan, answers: Mapping[str, Any], locked: Any, provision: str,
                 ) -> tuple[list[dict[str, Any]], list[Drift]]:
    rows, found = [], []
    files = answers.get("files") or {}
    for model in plan.models:
        path = str(PurePosixPath(plan.model_dir or DEFAULT_MODEL_DIR["linux"]) / model.file)
        state = files.get(path) or {}
        marker = state.get("marker") or {}
        lock_entry = locked.models.get(model.file) if locked is not None else None
        locked_sha = getattr(lock_entry, "sha256", None)
        row = {"file": model.file, "path": path, "size_bytes": state.get("size"), "sha256": model.sha256,
               "recorded_sha256": marker.get("sha256"), "locked_sha256": locked_sha, "ok": False}
        if not state.get("exists"):
            found.append(Drift("model-missing", f"{path} is not on the box", f"{provision} (downloads it)"))
        elif not marker:
            found.append(Drift("model-unverified", f"{path} has no install record ({path}.verified): it was "
                               "not installed by provision, or the record was removed",
                               f"{provision} (hashes it once, downloads it again if it differs)"))
        elif not state.get("matches"):
            changed = [what for what, key in (("size", "size"), ("mtime", "mtime_ns"), ("inode", "inode"),
                                               ("owner", "uid")) if marker.get(key) != state.get(key)]
            found.append(Drift("model-replaced", f"{path} is not the file checked at install (its "
                               f"{', '.join(changed)} changed): replaced or rewritten since",
                               f"{provision} (hashes it, downloads the planned file if it differs)"))
        elif model.sha256 and marker.get("sha256") != model.sha256:
            found.append(Drift("model-differs", f"{path} has sha256 {marker.get('sha256')}, the plan says "
                               f"{model.sha256}", f"{provision} (downloads the planned file)"))
        else:
            row["ok"] = True
        if locked_sha and model.sha256 and locked_sha != model.sha256:
            found.append(Drift("model-differs-from-lock", f"{model.file}: the plan says sha256 {model.sha256}, "
                               f"the lock {locked_sha}",
                               f"{provision} --locked (installs the locked file), or `controller lock --update` "
                               "to accept the plan"))
        rows.append(row)
    return rows, found


def _engine_drift(plan: ServePlan, answers: Mapping[str, Any], engine_root: str, locked: Any, provision: str,
                  ) -> tuple[list[dict[str, Any]], list[Drift]]:
    rows, found = [], []
    links = answers.get("links") or {}
    used = {service.engine for service in plan.services}
    for engine in plan.engines:
        if engine.id not in used:
            continue
        planned = engine.download.version if engine.download and engine.download.version else engine.commit
        link = f"{engine_root}/{engine.slot}/current"
        target = links.get(link)
        running = PurePosixPath(target).name if target else None
        lock_entry = locked.engines.get(engine.id) if locked is not None else None
        locked_commit = getattr(lock_entry, "commit", None)
        rows.append({"id": engine.id, "slot": engine.slot, "planned": planned, "running": running,
                     "locked": locked_commit})
        if running is None:
            found.append(Drift("engine-missing", f"{link} does not point at an installed version",
                               f"{provision} (installs {engine.id})"))
        elif running != planned:
            found.append(Drift("engine-switched", f"{link} points at {running}, the plan says {planned}",
                               f"{provision} (switches back to {planned}; the role keeps the other as `previous`)"))
        if locked is not None and lock_entry is None:
            found.append(Drift("engine-not-in-lock", f"the plan uses {engine.id}, which the lock does not name",
                               f"{provision} --locked, or `controller lock --update` to accept the plan"))
        elif locked_commit and locked_commit != engine.commit:
            found.append(Drift("engine-differs-from-lock", f"{engine.slot}: the plan says {engine.commit}, the lock "
                               f"{locked_commit}", f"{provision} --locked, or `controller lock --update`"))
    return rows, found


def _gpus(plan: ServePlan, answers: Mapping[str, Any]) -> list[dict[str, Any]]:
    planned: dict[str, int] = {}
    for service in plan.services:
        for device, mib in service.memory.per_device_mib.items():
            planned[device] = planned.get(device, 0) + mib
    gpus = []
    for gpu in answers.get("gpus") or []:
        entry = dict(gpu)
        index = gpu.get("index")
        entry["memory_planned_mib"] = planned.get(f"cuda{index}", planned.get(str(index)))
        gpus.append(entry)
    return gpus


def box_status(box: Box, plan: ServePlan | None, answers: Mapping[str, Any] | None, *, fleet_path: str,
               locked: Any = None, unreachable: str = "", failed: str = "",
               engine_root: str | None = None) -> BoxStatus:
    """What one box runs against its plan and its lock entry (``locked``: a ``controller.actions.lock.BoxLock``).

    ``engine_root``: where the box's engines live (``Inventory.engine_root``; None: the llama_engine role's own)."""
    provision = _provision(box.name, fleet_path)
    if plan is None:
        return BoxStatus(box.name, False, error="never provisioned from this inventory (no rendered plan)",
                         drift=[Drift("not-provisioned", "the inventory has no plan for this box", provision)])
    if unreachable:
        return BoxStatus(box.name, False, error=unreachable)
    if answers is None or not answers:
        return BoxStatus(box.name, True, error=failed or "the status play did not run to the end on this box")
    status = BoxStatus(box.name, True, error=failed, locked=locked is not None)
    units = answers.get("units") or {}
    servers = answers.get("servers") or {}
    for service in plan.services:
        unit = units.get(service.name) or {}
        server = servers.get(service.name) or {}
        served = list(server.get("served_ids") or [])
        models = service.models or [service.model]
        missing = [model for model in models if model not in served]
        healthy = server.get("health") == "ok" and not missing and not server.get("error")
        error = "" if healthy else (server.get("error") or (f"/health says {server.get('health')}"
                                                            if server.get("health") != "ok" else
                                                            f"does not list {', '.join(missing)}"))
        status.services.append(ServiceStatus(
            model=service.model, port=service.port, active=unit.get("active") == "active", healthy=healthy,
            served_model=service.model if service.model in served else (served[0] if served else None),
            name=service.name, state=f"{unit.get('active', '?')}/{unit.get('sub', '?')}",
            enabled=unit.get("enabled", ""), error=error, models=models,
            loaded=([model for model in server.get("loaded_ids") or [] if model in models]
                    if service.on_demand is not None else None)))
        status.drift += _unit_drift(service.name, unit, _edited(answers, f"/{service.name}.service"),
                                    _edited(answers, f"/{service.name}.env"), provision)
        if service.on_demand is not None and _edited(answers, service.on_demand.preset_file):
            status.drift.append(Drift("preset-edited", f"{service.on_demand.preset_file} differs from the plan's "
                                      f"models of {service.name}",
                                      f"{provision} (rewrites it and restarts the router)"))
        locked_service = locked.services.get(service.name) if locked is not None else None
        if locked is not None and locked_service is None:
            status.drift.append(Drift("service-not-in-lock", f"the plan has {service.name}, the lock does not",
                                      f"{provision} --locked, or `controller lock --update` to accept the plan"))
        elif locked_service is not None:
            differs = [what for what, mine, theirs in (
                ("port", service.port, locked_service.port), ("model", service.model, locked_service.model),
                ("arguments", service.args, locked_service.args), ("environment", service.env, locked_service.env),
                ("on-demand models", {item.id: item.preset for item in service.on_demand.models}
                 if service.on_demand is not None else None, locked_service.on_demand))
                if mine != theirs]
            if differs:
                status.drift.append(Drift("plan-differs-from-lock", f"{service.name}: the plan's "
                                          f"{', '.join(differs)} differ from the lock's",
                                          f"{provision} --locked, or `controller lock --update` to accept the plan"))
    status.models, model_drift = _model_drift(plan, answers, locked, provision)
    status.engines, engine_drift = _engine_drift(plan, answers, engine_root or role_engine_roots()[False], locked,
                                                 provision)
    status.drift += model_drift + engine_drift
    engine_of = {row["id"]: f"{row['slot']} {row['running'] or '-'}" for row in status.engines}
    status.services = [ServiceStatus(**{**asdict(s), "engine": engine_of.get(service.engine, "")})
                       for s, service in zip(status.services, plan.services, strict=True)]
    status.gpus = _gpus(plan, answers)
    status.gpu_error = "" if status.gpus else str(answers.get("gpu_error") or "")
    if plan.driver is not None and plan.driver.installs and plan.driver.branch:
        running = {str(gpu.get("driver_version") or "").split(".")[0] for gpu in status.gpus} - {""}
        if running and running != {str(plan.driver.branch)}:
            status.drift.append(Drift("driver-branch", f"the GPUs run driver {', '.join(sorted(running))}, the plan "
                                      f"says branch {plan.driver.branch}", f"{provision} (then reboot if it says so)"))
    return status


def run_status(fleet: Fleet, names: Sequence[str], inventory: Path, fleet_path: Path,
               on_event: EventHandler | None = None, locked: Mapping[str, Any] | None = None) -> list[BoxStatus]:
    """Read every named box at once (one run of playbooks/status.yml) and compare each with its plan and its lock
    entry (``locked``: the fleet lock's entries by box, ``controller.actions.lock.BoxLock``; None: no lock)."""
    folder = Inventory(inventory)
    plans: dict[str, ServePlan | None] = {}
    unreadable: dict[str, str] = {}
    for name in names:
        try:
            plans[name] = folder.find_plan(name)
        except NotRendered as damaged:
            plans[name], unreadable[name] = None, str(damaged)
    sealed = {name: when for name in names if (when := folder.sealed_at(name)) is not None}
    readable = [name for name in names
                if plans[name] is not None and fleet.box(name).os == "linux" and name not in sealed]
    result: RunResult | None = None
    if readable:
        result = run_playbook(PLAYBOOK, inventory=inventory, limit=",".join(readable), on_event=on_event,
                              forks=max(1, min(len(readable), MAX_FORKS)), raise_on_failure=False)
    published = (result.data.get(STATS_KEY) or {}) if result is not None else {}
    unreachable = {task.host: task.message for task in (result.failed if result else []) if task.unreachable}
    failed: dict[str, str] = {}
    for task in result.failed if result else []:
        if not task.unreachable:
            failed.setdefault(task.host, f"task '{task.task}' failed: {task.message}")
    boxes = []
    for name in names:
        box = fleet.box(name)
        if name in sealed:
            boxes.append(BoxStatus(name, False, sealed=sealed[name], error=f"{handed_over(sealed[name])}: the "
                                   "builder's SSH keys no longer open it, so status does not read it"))
            continue
        if name in unreadable:
            boxes.append(BoxStatus(name, False, error=unreadable[name]))
            continue
        if plans[name] is not None and box.os != "linux":
            boxes.append(BoxStatus(name, False, error="status reads Linux boxes only; use `controller verify` on "
                                   "a Windows box"))
            continue
        boxes.append(box_status(box, plans[name], published.get(name), fleet_path=str(fleet_path),
                                locked=locked.get(name) if locked is not None else None,
                                unreachable=unreachable.get(name, ""), failed=failed.get(name, ""),
                                engine_root=folder.engine_root(name)))
    return boxes
