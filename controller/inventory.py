"""The inventory folder: where each artefact lives, and the one way to read and write it.

Every other module goes through ``Inventory``; nothing else spells a path inside the folder::

    hosts.yml                   every box of the fleet, in groups (render)
    workstations.yml            the fleet's workstations (controller provision WORKSTATION)
    host_vars/<name>.yml        what the roles install on a box, or wire on a workstation
    probes/<box>.json           the hardware profile the groups and the plan came from
    plans/<box>.json            the serving plan, with its reasons
    reports/<box>.json, .md     the provisioning report
    reports/<box>.certify.*     the certification report (json, md, html, pdf); it records the seal
    known_hosts                 the boxes' SSH host keys, checked by the probe and by Ansible
    artifacts/, facts/          ansible-runner's artifacts and Ansible's fact cache
    .lock                       the inventory mutex: one controller at a time renders and runs here
    .run.lock                   the run mutex: held shared by every process of a run until the last one ended

Readers are typed (a plan is a ``ServePlan``, a probe a ``HardwareProfile``); a box whose plan or host_vars were
never rendered is ``controller.errors.NotRendered`` (exit 1), the one way every command says so. Writers replace
a file atomically (``controller.files.write_atomic``). The two mutex files keep the names earlier controllers
gave them, so a controller of either version waits for the other on the same inventory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from controller import COLLECTION
from controller.errors import NotRendered, SetupError
from controller.files import to_stderr, write_atomic
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan

DEFAULT_FOLDER = "inventory"  # beside the fleet file, when a command is given no --inventory
# The llama_engine role's own variables: where it puts the engines when the box's vars do not say otherwise.
ENGINE_ROLE_VARS = COLLECTION / "roles" / "llama_engine" / "vars" / "main.yml"
CERTIFY_KINDS = {"markdown": "md", "json": "json", "html": "html", "pdf": "pdf"}

Notice = Callable[[str], None]


class RenderedLoader(yaml.SafeLoader):
    """Reads what render wrote, ``!unsafe`` strings included (as plain strings), without Ansible."""


RenderedLoader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


def read_rendered(text: str) -> Any:
    """A rendered inventory file as data: the values Ansible sees, none of them evaluated."""
    return yaml.load(text, Loader=RenderedLoader)  # noqa: S506 - a SafeLoader subclass


def sealed_at(report: Mapping[str, Any]) -> str | None:
    """When a certification report's box was sealed (None: not sealed)."""
    seal = report.get("seal")
    if isinstance(seal, Mapping):
        return str(seal.get("sealed_at") or "an unrecorded time")
    return None


def handed_over(when: str) -> str:
    """What every command that would need the builder's access says about a sealed box."""
    return f"sealed at {when} and handed over to its buyer"


@functools.cache
def role_engine_roots() -> dict[bool, str]:
    """The llama_engine role's engine folder by "is this Windows" (its vars/main.yml), read once."""
    try:
        defaults = yaml.safe_load(ENGINE_ROLE_VARS.read_text())["_llama_engine_os_defaults"]
        return {windows: str(defaults[windows]["root"]) for windows in (False, True)}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise SetupError(f"cannot read the llama_engine role's engine folder from {ENGINE_ROLE_VARS} ({exc}); "
                         "reinstall the controller with its collection") from None


@dataclass(frozen=True)
class Inventory:
    """The rendered inventory folder ``root``."""

    root: Path

    @classmethod
    def beside(cls, fleet_path: Path) -> Inventory:
        """The default inventory: ``inventory/`` beside the fleet file."""
        return cls(fleet_path.resolve().parent / DEFAULT_FOLDER)

    # ------------------------------------------------------------ where each artefact lives

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts.yml"

    @property
    def workstations_file(self) -> Path:
        return self.root / "workstations.yml"

    @property
    def known_hosts_file(self) -> Path:
        return self.root / "known_hosts"

    @property
    def reports_folder(self) -> Path:
        return self.root / "reports"

    @property
    def artifacts_folder(self) -> Path:
        return self.root / "artifacts"

    @property
    def facts_folder(self) -> Path:
        return self.root / "facts"

    @property
    def mutex_file(self) -> Path:
        return self.root / ".lock"

    @property
    def run_mutex_file(self) -> Path:
        """Every process of a run of this inventory holds it shared (controller.stages.runner hands it to the run),
        so the run counts as alive until its last process (ansible-playbook and each of its workers) ended."""
        return self.root / ".run.lock"

    def host_vars_file(self, name: str) -> Path:
        return self.root / "host_vars" / f"{name}.yml"

    @property
    def task_counts_file(self) -> Path:
        """How many task results the last full run of each playbook had per box (the progress bar's total)."""
        return self.root / ".task-counts.json"

    def expected_tasks(self, playbook: str, boxes: int) -> int | None:
        try:
            per_box = json.loads(self.task_counts_file.read_text()).get(playbook)
        except (OSError, ValueError, AttributeError):
            return None
        return int(per_box * boxes) if isinstance(per_box, (int, float)) and per_box > 0 else None

    def record_tasks(self, playbook: str, boxes: int, results: int) -> None:
        try:
            counts = json.loads(self.task_counts_file.read_text())
        except (OSError, ValueError):
            counts = {}
        if not isinstance(counts, dict):
            counts = {}
        counts[playbook] = round(results / max(boxes, 1), 1)
        write_atomic(self.task_counts_file, json.dumps(counts, sort_keys=True) + "\n")

    @property
    def last_ok_file(self) -> Path:
        """Each box's rendered inputs (``controller.stages.strategy.inputs_stamp``) at its last provision that
        ended ok: which Ansible strategy its next run goes under."""
        return self.root / ".last-ok-inputs.json"

    def last_ok_inputs(self) -> dict[str, str]:
        try:
            stamps = json.loads(self.last_ok_file.read_text())
        except (OSError, ValueError):
            return {}
        return {str(box): str(stamp) for box, stamp in stamps.items()} if isinstance(stamps, dict) else {}

    def record_last_ok(self, stamps: Mapping[str, str | None]) -> None:
        """Set each box's stamp (None: forget the box, whose run did not end ok)."""
        kept = self.last_ok_inputs()
        for box, stamp in stamps.items():
            if stamp is None:
                kept.pop(box, None)
            else:
                kept[box] = stamp
        write_atomic(self.last_ok_file, json.dumps(kept, sort_keys=True) + "\n")

    @property
    def probes_folder(self) -> Path:
        return self.root / "probes"

    def probe_file(self, box: str) -> Path:
        return self.probes_folder / f"{box}.json"

    def plan_file(self, box: str) -> Path:
        return self.root / "plans" / f"{box}.json"

    def report_files(self, box: str) -> tuple[Path, Path]:
        """The provisioning report: JSON and Markdown."""
        return self.reports_folder / f"{box}.json", self.reports_folder / f"{box}.md"

    def certify_files(self, box: str) -> dict[str, Path]:
        """The certification report by kind: markdown, json, html, pdf (absolute paths: the report names them)."""
        folder = self.reports_folder.resolve()
        return {kind: folder / f"{box}.certify.{ext}" for kind, ext in CERTIFY_KINDS.items()}

    # ------------------------------------------------------------ readers

    def find_plan(self, box: str) -> ServePlan | None:
        """The plan last rendered for ``box``; None when it was never rendered. A damaged one is NotRendered."""
        path = self.plan_file(box)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise NotRendered(f"{path}: cannot read the plan ({exc.strerror}); run `controller render {box}` "
                              "again") from None
        try:
            return ServePlan.model_validate_json(data)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise NotRendered(f"{path} is not a plan this controller wrote ({first}); run `controller render {box}` "
                              "again") from None

    def plan(self, box: str) -> ServePlan:
        """The plan last rendered for ``box``; NotRendered when there is none."""
        plan = self.find_plan(box)
        if plan is None:
            raise NotRendered(f"{self.root} has no plan for {box}: the box was never provisioned from this "
                              f"inventory; run `controller provision {box}` (or `controller render {box}`) first")
        return plan

    def probe(self, box: str) -> HardwareProfile | None:
        """The profile last rendered for ``box``; None when there is none or it cannot be read."""
        try:
            return HardwareProfile.model_validate_json(self.probe_file(box).read_bytes())
        except (OSError, ValueError):
            return None

    def probes(self, warn: Notice = to_stderr) -> dict[str, HardwareProfile]:
        """Every box's saved probe; an unreadable one is left out with a warning.

        One box's damaged artefact must not stop the render of another: the box it belongs to keeps only
        its OS group in hosts.yml until it is probed again.
        """
        profiles = {}
        for path in sorted(self.probes_folder.glob("*.json")):
            try:
                profiles[path.stem] = HardwareProfile.model_validate_json(path.read_bytes())
            except (OSError, ValueError) as exc:
                reason = getattr(exc, "strerror", None) or "not a `controller probe --json` profile"
                warn(f"warning: {path}: {reason}; {path.stem} keeps only its OS group in hosts.yml until "
                     f"`controller render {path.stem}` probes it again")
        return profiles

    def require_host_vars(self, name: str) -> Path:
        """The box's rendered host_vars file; NotRendered when it was never rendered."""
        path = self.host_vars_file(name)
        if not path.is_file():
            raise NotRendered(f"{self.root} has no rendered inventory for {name}; run `controller render {name}` "
                              "first")
        return path

    def host_vars(self, name: str) -> dict[str, Any]:
        """The variables rendered for ``name`` as Ansible reads them, none evaluated ({} when there are none)."""
        try:
            data = read_rendered(self.host_vars_file(name).read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}

    def engine_root(self, box: str, windows: bool = False) -> str:
        """Where the box's engines live: its rendered ``llama_engine_root`` (the fleet's vars), else the role's own."""
        root = self.host_vars(box).get("llama_engine_root")
        return root if isinstance(root, str) and "{" not in root else role_engine_roots()[windows]

    def _json(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def report(self, box: str) -> dict[str, Any] | None:
        """The box's last provisioning report (None: never provisioned from this inventory, or unreadable)."""
        return self._json(self.report_files(box)[0])

    def certify_report(self, box: str) -> dict[str, Any] | None:
        """The box's last certification report (None: never certified from this inventory, or unreadable)."""
        return self._json(self.certify_files(box)["json"])

    def sealed_at(self, box: str) -> str | None:
        """When this inventory sealed the box (its certification report records the seal); None: it did not."""
        return sealed_at(self.certify_report(box) or {})

    # ------------------------------------------------------------ writers

    def write_probe(self, box: str, profile: HardwareProfile) -> Path:
        return self._write(self.probe_file(box), json.dumps(profile.model_dump(mode="json"), indent=2) + "\n")

    def write_plan(self, box: str, plan: ServePlan) -> Path:
        return self._write(self.plan_file(box), json.dumps(plan.model_dump(mode="json"), indent=2) + "\n")

    def remove_plan(self, box: str) -> None:
        """Forget the box's plan (it gets only the driver now), so the inventory never describes services it lacks."""
        self.plan_file(box).unlink(missing_ok=True)

    def write_host_vars(self, name: str, text: str) -> Path:
        return self._write(self.host_vars_file(name), text)

    def write_hosts(self, text: str) -> Path:
        return self._write(self.hosts_file, text)

    def write_workstations(self, text: str) -> Path:
        return self._write(self.workstations_file, text)

    def write_report(self, report: Mapping[str, Any], markdown: str) -> tuple[Path, Path]:
        """The provisioning report of ``report["box"]``, as JSON and as Markdown."""
        json_path, md_path = self.report_files(str(report["box"]))
        self._write(json_path, json.dumps(report, indent=2) + "\n")
        self._write(md_path, markdown)
        return json_path, md_path

    @staticmethod
    def _write(path: Path, text: str) -> Path:
        write_atomic(path, text)
        return path

    # ------------------------------------------------------------ one controller at a time

    @contextlib.contextmanager
    def mutex(self, what: str, notice: Notice | None = None) -> Iterator[None]:
        """Hold the inventory mutex (``.lock``, fcntl.flock) for the length of a render or run.

        A second controller on the same inventory waits here, saying once who holds it, instead of
        interleaving its renders and runs with the first; Ctrl-C gives up waiting. Re-entrant within one
        process (provision renders, then runs, under the one mutex). A controller that was killed leaves the
        mutex free, but its run may not be over yet: this waits for that too (``run_mutex_file``).
        """
        folder = self.root.resolve()
        if folder in _held:
            _held[folder] += 1
            try:
                yield
            finally:
                _held[folder] -= 1
            return
        folder.mkdir(parents=True, exist_ok=True)
        inventory = Inventory(folder)
        path = inventory.mutex_file
        say = notice or to_stderr
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = path.read_text().strip() or "another controller"
                say(f"inventory {folder} is in use by {holder}; waiting for it to finish (Ctrl-C to give up)")
                fcntl.flock(fd, fcntl.LOCK_EX)
            inventory._wait_for_runs(os.pread(fd, 4096, 0).decode(errors="replace").strip(), say)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} ({what})\n".encode(), 0)
            _held[folder] = 1
            try:
                yield
            finally:
                del _held[folder]
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the descriptor releases the mutex

    def _wait_for_runs(self, last_holder: str, notice: Notice) -> None:
        """Return once no process of a run of this inventory lives on (normally at once: a run ends with its
        controller)."""
        fd = os.open(self.run_mutex_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                notice(f"inventory {self.root}: the run of {last_holder or 'a controller'}, which ended, is still "
                       "stopping; waiting for its last task to end (Ctrl-C to give up)")
                fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)  # released at once: this controller's own run takes it shared


_held: dict[Path, int] = {}  # inventory folders whose mutex this process holds, with their nesting depth

