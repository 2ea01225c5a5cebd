"""The fleet's lock: what exactly each box runs, so that boxes provisioned from it end up identical.

One lock per fleet file, beside it: ``fleet.yml`` -> ``fleet.lock.yml`` (``lock_path``). YAML with sorted
keys, boxes and their entries sorted by name, no timestamps: a rerun that changes nothing rewrites the
same bytes, and a change reads as a small diff. Shape (``Lock``; ``version`` says which shape)::

    version: 1
    fleet:
      file: fleet.yml          # the fleet file's name, relative to the lock's folder
      sha256: 9f2c...          # digest of every box's definition and the catalogs: informative
    boxes:
      box1:                    # one entry per box provisioned or locked; the fleet must still name it
        definition:            # the box's settings in the fleet that change what is installed (no
          models: [...]        # address, user or secrets): models, agents, model_dir, bind, allow_from,
          base_port: 8001      # base_port, driver, gateway, vars, os (not mirror: checksums pin the bytes)
        driver:
          manage: true
          branch: 580          # the planned Linux driver branch (null: none planned)
          installed: 580.82.07 # what the probe saw installed when the lock was written (informative)
        engines:               # by engine catalog id
          upstream-02182fc: {slot: upstream, commit: 02182fc, platform: linux-x86_64,
                             file: llama-...tar.gz, sha256: 1c0f...}
        models:                # by file name in the model folder
          gemma-4-26B_q4_0-it.gguf: {id: gemma4-26b-a4b-qat-q4_0, sha256: 7a1d..., size_bytes: 14390000000}
        templates:             # chat templates the services use: roles/llama_service/files/chat-templates
          gemma4-nothink.jinja: {sha256: 0d3e...}
        services:              # by unit name: the plan as the box runs it
          llama-gemma4-26b-a4b-qat-q4_0:
            model: gemma4-26b-a4b-qat-q4_0
            engine: upstream-02182fc
            host: 127.0.0.1
            port: 8011
            args: [-m, ..., --port, '8011']
            env: {LLAMA_ARG_...: ...}
            template: gemma4-nothink.jinja

What is compared (``differences``): everything above except ``driver.installed`` and the fleet's
``sha256``. ``controller provision --locked`` plans the box afresh, builds its entry (``box_entry``) and
refuses, before rendering or running anything, when it differs from the lock's entry, naming the first
difference in one line (``controller.errors.LockError``, exit 7). A lock written for another fleet file
(its ``fleet.file`` differs, or it names none of the fleet's boxes) and a lock that names a box the fleet
no longer has are refused the same way. A file the lock pins no sha256 for (the catalog pins none) is
refused by ``--locked`` too: it could not be installed exactly.

An engine pack the catalog pins no sha256 for is locked with the sha256 its mirror's SHA256SUMS gives
(the file the box checks the pack against), so a changed SHA256SUMS is a difference too.

Layout of this module: the model, then pure build/compare functions, then reading and writing the file
(``read_lock``; ``guard``, what provisioning checks before it touches a box; ``record``: a read-modify-write under
a flock on the fleet file). It probes and plans nothing: ``controller.actions.provision`` guards the lock before a
run and records the boxes that ran after it, and ``controller lock`` (``lock_fleet``) plans boxes in
``controller.actions.fleetrun``, beside ``probe_and_plan``, so this module stays below everything that reads it.
``controller status`` compares a box against ``read_lock(...).boxes[name]`` (``BoxLock``).
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller import COLLECTION
from controller.errors import LockError
from controller.files import write_atomic
from controller.model.fleet import Box, Fleet
from controller.model.inputs import LOCK_MAX_BYTES, BoundedLoader, read_bounded
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan

LOCK_VERSION = 1
# The chat templates llama_service installs, in the collection beside the package (a clone's, or the one a wheel put
# in site-packages).
TEMPLATE_FILES = COLLECTION / "roles" / "llama_service" / "files" / "chat-templates"
# The fields of a fleet box that change what is installed on it; the others say how to reach it, or (mirror) where
# the bytes come from, which the checksums pin.
DEFINITION_FIELDS = ("os", "models", "agents", "model_dir", "bind", "allow_from", "base_port", "driver",
                     "gateway", "vars")
LATER_MODEL_FIELDS = ("gpus", "board", "spill", "on_demand")  # a wanted model's placement (issue 24): absent when unset
UPDATE_HINT = "run `controller lock --fleet {fleet} --update` to accept it"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LockedFleet(_Strict):
    file: str
    sha256: str


class LockedDriver(_Strict):
    manage: bool = True
    branch: int | None = None
    installed: str | None = None  # seen by the probe when the entry was written; never compared


class LockedEngine(_Strict):
    slot: str
    commit: str
    platform: str
    file: str | None = None
    sha256: str | None = None


class LockedModel(_Strict):
    id: str
    sha256: str | None = None
    size_bytes: int | None = None


class LockedTemplate(_Strict):
    sha256: str


class LockedService(_Strict):
    model: str
    engine: str
    host: str
    port: int
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    template: str | None = None
    # an on-demand router's models: each one's preset section (its flags live there, not in args); None otherwise
    on_demand: dict[str, dict[str, str]] | None = None


class BoxLock(_Strict):
    definition: dict[str, Any] = Field(default_factory=dict)
    driver: LockedDriver = Field(default_factory=LockedDriver)
    engines: dict[str, LockedEngine] = Field(default_factory=dict)
    models: dict[str, LockedModel] = Field(default_factory=dict)
    templates: dict[str, LockedTemplate] = Field(default_factory=dict)
    services: dict[str, LockedService] = Field(default_factory=dict)
    gateway: dict[str, Any] | None = None  # the box's planned gateway (controller.model.serveplan.GatewayPlan)


class Lock(_Strict):
    version: Literal[1] = LOCK_VERSION
    fleet: LockedFleet
    boxes: dict[str, BoxLock] = Field(default_factory=dict)


def lock_path(fleet_path: Path) -> Path:
    """``fleet.yml`` -> ``fleet.lock.yml`` beside it."""
    return fleet_path.with_name(f"{fleet_path.stem}.lock.yml")


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def definition(box: Box) -> dict[str, Any]:
    """The box's settings that change what is installed, as JSON (what the lock compares)."""
    data = json.loads(json.dumps(box.model_dump(mode="json", include=set(DEFINITION_FIELDS))))
    for wanted in data.get("models", []):  # settings added since locks were first written count only when set,
        for key in LATER_MODEL_FIELDS:     # so an older lock still matches a fleet that does not use them
            if wanted.get(key) is None or wanted.get(key) is False:  # board 0 is a setting: compare by identity
                wanted.pop(key, None)
    return data


def fleet_digest(fleet: Fleet) -> str:
    return _digest({"boxes": {name: definition(box) for name, box in fleet.boxes.items()},
                    "catalogs": [path.name for path in fleet.catalogs]})


def template_digests(names: Iterator[str] | list[str] | set[str], folder: Path = TEMPLATE_FILES) -> dict[str, str]:
    """sha256 of each chat template the role ships; a name the role lacks is left out (render refuses it)."""
    digests = {}
    for name in sorted(set(names)):
        with contextlib.suppress(OSError):
            digests[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    return digests


def box_entry(box: Box, profile: HardwareProfile | None, plan: ServePlan, templates: Mapping[str, str]) -> BoxLock:
    """What the lock records for a box planned as ``plan`` (templates: name -> sha256, ``template_digests``)."""
    driver = plan.driver
    return BoxLock(
        definition=definition(box),
        driver=LockedDriver(manage=driver.manage if driver else box.driver.manage,
                            branch=driver.branch if driver else None,
                            installed=profile.driver.version if profile else None),
        engines={pack.id: LockedEngine(slot=pack.slot, commit=pack.commit, platform=pack.platform,
                                       file=pack.download.file if pack.download else None,
                                       sha256=pack.download.sha256 if pack.download else None)
                 for pack in plan.engines},
        models={item.file: LockedModel(id=item.id, sha256=item.sha256, size_bytes=item.size_bytes)
                for item in plan.models},
        templates={name: LockedTemplate(sha256=digest) for name, digest in templates.items()
                   if name in plan.templates()},
        services={service.name: LockedService(model=service.model, engine=service.engine, host=service.host,
                                              port=service.port, args=list(service.args), env=dict(service.env),
                                              template=service.template,
                                              on_demand={item.id: dict(item.preset) for item in service.on_demand.models}
                                              if service.on_demand is not None else None)
                  for service in plan.services},
        gateway=plan.gateway.model_dump(mode="json") if plan.gateway else None,
    )


def _short(value: Any) -> str:
    if value is None:
        return "none"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text[:12] + "…" if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def _args_change(old: list[str], new: list[str]) -> str:
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag != "equal":
            before, after = old[i1:i2], new[j1:j2]
            flag = old[i1 - 1] if i1 > 0 and old[i1 - 1].startswith("-") else ""  # a changed value: name its flag
            named = f"{flag}: " if flag and not any(item.startswith("-") for item in before + after) else ""
            return f"{named}the lock has '{' '.join(before)}', now '{' '.join(after)}'"
    return "same arguments"


def _field_changes(where: str, old: BaseModel | None, new: BaseModel | None, fields: tuple[str, ...]) -> list[str]:
    lines = []
    for name in fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if name == "args":
            lines.append(f"{where} arguments differ: {_args_change(before, after)}")
        else:
            lines.append(f"{where} {name} is now {_short(after)}, the lock says {_short(before)}")
    return lines


def _keyed(what: str, old: Mapping[str, BaseModel], new: Mapping[str, BaseModel], fields: tuple[str, ...],
           ) -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            lines.append(f"{what} {key} is in the lock, not in the plan now")
        elif key not in old:
            lines.append(f"{what} {key} is in the plan now, not in the lock")
        else:
            lines += _field_changes(f"{what} {key}:", old[key], new[key], fields)
    return lines


def _engines(old: Mapping[str, LockedEngine], new: Mapping[str, LockedEngine]) -> list[str]:
    """Engines are compared by slot, so a new pinned version reads as one change ('a newer engine')."""
    lines = []
    old_slots = {entry.slot: (engine_id, entry) for engine_id, entry in old.items()}
    new_slots = {entry.slot: (engine_id, entry) for engine_id, entry in new.items()}
    for slot in sorted(set(old_slots) | set(new_slots)):
        if slot not in new_slots:
            lines.append(f"engine {old_slots[slot][0]} is in the lock, not in the plan now")
        elif slot not in old_slots:
            lines.append(f"engine {new_slots[slot][0]} is in the plan now, not in the lock")
        else:
            (old_id, before), (new_id, after) = old_slots[slot], new_slots[slot]
            if old_id != new_id or before.commit != after.commit:
                lines.append(f"engine {slot}: the catalog now gives {new_id} (commit {after.commit}), the lock says "
                             f"{old_id} (commit {before.commit})")
            else:
                lines += _field_changes(f"engine {new_id}:", before, after, ("platform", "file", "sha256"))
    return lines


def differences(locked: BoxLock, fresh: BoxLock) -> list[str]:
    """Each way ``fresh`` (the box planned now) differs from ``locked``, one line each, in a stable order."""
    lines = []
    for key in sorted(set(locked.definition) | set(fresh.definition)):
        if locked.definition.get(key) != fresh.definition.get(key):
            lines.append(f"the fleet's {key} for the box is now {_short(fresh.definition.get(key))}, "
                         f"the lock says {_short(locked.definition.get(key))}")
    lines += _field_changes("driver:", locked.driver, fresh.driver, ("manage", "branch"))
    lines += _engines(locked.engines, fresh.engines)
    lines += _keyed("model file", locked.models, fresh.models, ("id", "sha256", "size_bytes"))
    lines += _keyed("chat template", locked.templates, fresh.templates, ("sha256",))
    lines += _keyed("service", locked.services, fresh.services,
                    ("model", "engine", "host", "port", "args", "env", "template", "on_demand"))
    if locked.gateway != fresh.gateway:
        lines.append("gateway: the planned gateway differs from the lock's")
    return lines


def unpinned(entry: BoxLock) -> list[str]:
    """Files the entry pins no checksum for: a locked install could not be exact."""
    return ([f"engine {engine_id} pack" for engine_id, engine in sorted(entry.engines.items())
             if engine.file and not engine.sha256]
            + [f"model file {name}" for name, model in sorted(entry.models.items()) if not model.sha256])


def check_fleet_file(lock: Lock, fleet: Fleet, fleet_path: Path, path: Path) -> None:
    """Refuse a lock written for another fleet file: another file name, or none of this fleet's boxes."""
    if lock.fleet.file != fleet_path.name or (lock.boxes and not set(lock.boxes) & set(fleet.boxes)):
        theirs = ", ".join(sorted(lock.boxes)) or "no boxes"
        raise LockError(f"{path} was written for fleet file {lock.fleet.file} ({theirs}), not {fleet_path.name}: "
                        f"pass this fleet's own lock, or remove it and run `controller lock --fleet {fleet_path}`")


def check_fleet(lock: Lock, fleet: Fleet, fleet_path: Path, path: Path) -> None:
    """Refuse a lock written for another fleet file, or one that names a box the fleet no longer has."""
    check_fleet_file(lock, fleet, fleet_path, path)
    gone = sorted(set(lock.boxes) - set(fleet.boxes))
    if gone:
        raise LockError(f"{path} names box {', '.join(gone)}, which {fleet_path.name} no longer has: "
                        f"run `controller lock --fleet {fleet_path} --update` to drop it")


def check_box(lock: Lock, box_name: str, fresh: BoxLock, fleet_path: Path, path: Path) -> None:
    """Refuse to install ``fresh`` on the box unless it is exactly what the lock says; the first difference named."""
    locked = lock.boxes.get(box_name)
    if locked is None:
        raise LockError(f"box {box_name} is not in {path}: run `controller lock --fleet {fleet_path} --update` "
                        "(or provision it without --locked) to add it")
    changes = differences(locked, fresh)
    if changes:
        more = f" (and {len(changes) - 1} more difference{'s' * (len(changes) > 2)})" if len(changes) > 1 else ""
        raise LockError(f"box {box_name}: {changes[0]}{more}; nothing was changed: "
                        + UPDATE_HINT.format(fleet=fleet_path))
    missing = unpinned(locked)
    if missing:
        raise LockError(f"box {box_name}: {path} pins no sha256 for {missing[0]}, so it cannot be installed "
                        "exactly: pin its sha256 in the catalog, then run "
                        f"`controller lock --fleet {fleet_path} --update`")


def updated(lock: Lock | None, fleet: Fleet, fleet_path: Path, entries: Mapping[str, BoxLock]) -> Lock:
    """The lock with ``entries`` written in and the boxes the fleet no longer names dropped."""
    boxes = {name: entry for name, entry in (lock.boxes.items() if lock else ()) if name in fleet.boxes}
    boxes.update(entries)
    return Lock(fleet=LockedFleet(file=fleet_path.name, sha256=fleet_digest(fleet)), boxes=dict(sorted(boxes.items())))


def changes(old: Lock | None, new: Lock) -> list[str]:
    """What an update changed, one line each, prefixed by the box (for ``controller lock --update``)."""
    before = old.boxes if old else {}
    lines = [f"{name}: removed (the fleet no longer names it)" for name in sorted(set(before) - set(new.boxes))]
    for name, entry in new.boxes.items():
        if name not in before:
            lines.append(f"{name}: added")
        else:
            lines += [f"{name}: {line}" for line in differences(before[name], entry)]
    return lines


def dumps(lock: Lock) -> str:
    body = yaml.safe_dump(lock.model_dump(mode="json"), sort_keys=True, default_flow_style=False, width=100)
    return ("# Written by `controller lock` and `controller provision`; refresh it with `controller lock --update`.\n"
            + body)


def read_lock(path: Path) -> Lock | None:
    """The lock at ``path`` (None: there is none); a damaged one is refused with what to do."""
    try:
        text = read_bounded(path, LOCK_MAX_BYTES).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise LockError(f"{path}: cannot read the lock ({reason}); remove it and run `controller lock`") from None
    try:
        return Lock.model_validate(yaml.load(text, Loader=BoundedLoader))  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, ValidationError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LockError(f"{path}: not a lock this controller writes ({first}); restore it from version control "
                        "or remove it and run `controller lock`") from None


@contextlib.contextmanager
def held(fleet_path: Path) -> Iterator[None]:
    """Hold a flock on the fleet file while its lock is read and written, so runs side by side lose no entries
    (the lock itself is replaced by a rename, so it cannot carry the flock; the fleet file always exists)."""
    try:
        fd = os.open(fleet_path, os.O_RDONLY)
    except OSError as exc:
        raise LockError(f"{fleet_path}: cannot open the fleet file to write its lock: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def guard(fleet: Fleet, fleet_path: Path, names: list[str], *, locked: bool, path: Path | None = None) -> Lock | None:
    """Before provisioning touches any box. With ``locked``: the lock must be there, be this fleet's and name every
    box of ``names``; it is returned, and each box's fresh entry is then compared with ``check_box``. Without it:
    only a lock written for another fleet file is refused (provisioning will record into it); returns None."""
    path = path or lock_path(fleet_path)
    existing = read_lock(path)
    if not locked:
        if existing is not None:
            check_fleet_file(existing, fleet, fleet_path, path)
        return None
    if existing is None:
        raise LockError(f"{fleet_path} has no lock ({path}): run `controller lock --fleet {fleet_path}` "
                        "(or provision without --locked) to write one")
    check_fleet(existing, fleet, fleet_path, path)
    for name in names:
        fleet.box(name)
        if name not in existing.boxes:
            raise LockError(f"box {name} is not in {path}: run `controller lock --fleet {fleet_path} --update` "
                            "(or provision it without --locked) to add it")
    return existing


def record(path: Path, fleet: Fleet, fleet_path: Path, entries: Mapping[str, BoxLock]) -> list[str]:
    """Write ``entries`` into the lock at ``path`` (creating it); returns what changed."""
    with held(fleet_path):
        old = read_lock(path)
        if old is not None:
            check_fleet_file(old, fleet, fleet_path, path)
        new = updated(old, fleet, fleet_path, entries)
        if old is None or dumps(new) != dumps(old):
            write_atomic(path, dumps(new))
        return changes(old, new)



# A box's entry as provisioning records it: the pure entry, with the sha256 an engine mirror's SHA256SUMS gives a pack
# the catalog pins none for (the one read of the network here).

def entry_for(box: Box, profile: HardwareProfile | None, plan: ServePlan) -> BoxLock:
    entry = box_entry(box, profile, plan, template_digests(plan.templates()))
    sums = {pack.id: pack.download.sha256sums_url for pack in plan.engines
            if pack.download and not pack.download.sha256 and pack.download.sha256sums_url}
    for engine_id, url in sums.items():  # the catalog pins none: the mirror's SHA256SUMS, which the box checks
        entry.engines[engine_id].sha256 = sha256_from_sums(url, entry.engines[engine_id].file or "")
    return entry


def parse_sums(text: str, file: str) -> str | None:
    """The sha256 a SHA256SUMS text gives ``file`` (``<hex>  <name>`` or ``<hex> *<name>``), None if it has none."""
    for line in text.splitlines():
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == file and len(digest) == 64:
            return digest.lower()
    return None


def sha256_from_sums(url: str, file: str, timeout: float = 30.0) -> str:
    import httpx

    try:
        response = httpx.get(url, follow_redirects=True, timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise LockError(f"cannot read {url} to lock the sha256 of {file} ({exc}): check the fleet's "
                        "mirror.engines, or pin the pack's sha256 in a catalog file") from None
    digest = parse_sums(response.text, file)
    if digest is None:
        raise LockError(f"{url} lists no sha256 for {file}: fix the mirror's SHA256SUMS, or pin the pack's sha256 "
                        "in a catalog file")
    return digest
