"""Run the checks on a rendered box: playbooks/verify.yml (the llama_verify role) and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.errors import ControllerError
from controller.files import inventory_lock
from controller.model.fleet import Fleet
from controller.stages.render import secrets_for
from controller.stages.runner import EventHandler, RunResult, run_playbook
from controller.stages.verify.verdict import results

PLAYBOOK = "verify.yml"


class NotRendered(ControllerError):
    """verify checks what render wrote and provision installed; it has nothing to check without an inventory."""

    exit_code = 1


def run_verify(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
               ) -> tuple[dict[str, Any], RunResult]:
    """Run verify.yml on ``box_name``'s rendered inventory; return what its checks answered and the run.

    Raise NotRendered when the inventory has no host_vars for the box, RunError when a check fails
    (the message names the server and what it answered).
    """
    box = fleet.box(box_name)
    with inventory_lock(inventory, f"verify {box.name}"):
        if not (inventory / "host_vars" / f"{box.name}.yml").is_file():
            raise NotRendered(f"{inventory} has no rendered inventory for {box.name}; run "
                              f"`controller render {box.name}` first")
        run = run_playbook(PLAYBOOK, inventory=inventory, limit=box.name, secrets=secrets_for(box),
                           on_event=on_event)
    return results(run, box), run
