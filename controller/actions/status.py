"""``controller status``: the fleet's lock read once, then the status stage over the selected boxes. Read-only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from controller.actions.lock import lock_path, read_lock
from controller.model.fleet import Fleet
from controller.stages.runner import EventHandler
from controller.stages.verify.status import BoxStatus, run_status


def fleet_status(fleet: Fleet, fleet_path: Path, names: Sequence[str], inventory: Path,
                 on_event: EventHandler | None = None) -> list[BoxStatus]:
    """What each named box runs, against its rendered plan and the fleet's lock entry for it (when there is a lock)."""
    lock = read_lock(lock_path(fleet_path))
    return run_status(fleet, names, inventory, fleet_path, on_event=on_event,
                      locked=None if lock is None else dict(lock.boxes))
