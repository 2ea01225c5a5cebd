"""Run the checks on a rendered box: playbooks/verify.yml (the llama_verify role) and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.inventory import Inventory
from controller.model.fleet import Fleet
from controller.stages.render import secrets_for
from controller.stages.runner import EventHandler, RunResult, run_playbook
from controller.stages.verify.verdict import results

PLAYBOOK = "verify.yml"


def run_verify(fleet: Fleet, box_name: str, inventory: Path, on_event: EventHandler | None = None,
               ) -> tuple[dict[str, Any], RunResult]:
    """Run verify.yml on ``box_name``'s rendered inventory; return what its checks answered and the run.

    Raise NotRendered (controller.errors) when the inventory has no host_vars for the box, RunError when a check fails
    (the message names the server and what it answered).
    """
    box = fleet.box(box_name)
    folder = Inventory(inventory)
    with folder.mutex(f"verify {box.name}"):
        folder.require_host_vars(box.name)  # verify checks what render wrote: nothing to check without it
        run = run_playbook(PLAYBOOK, inventory=inventory, limit=box.name, secrets=secrets_for(box),
                           on_event=on_event)
    return results(run, box), run
