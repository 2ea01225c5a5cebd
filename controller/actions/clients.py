"""``controller clients``: what an agent client needs to use a box's services.

The values come from the box's rendered plan (``controller.inventory``) and the box's API key secret, through the
pure projection in ``controller.model.clients`` (the JSON contract is described there); a box this inventory
sealed is refused, its keys are the buyer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.errors import FleetError
from controller.inventory import Inventory
from controller.model.clients import client_config
from controller.model.fleet import Box, Fleet, check_api_key


def box_api_key(box: Box) -> str:
    if box.api_key is None:
        raise FleetError(f"box {box.name}: its servers use keys generated on the box, which the controller never "
                         f"sees; set api_key (env: or file:) in the fleet file and provision again")
    what = f"box {box.name} api_key"
    return check_api_key(box.api_key.resolve(what), what)


def clients_for(fleet: Fleet, box_name: str, inventory: Path, only: str | None = None) -> dict[str, Any]:
    """The ``controller clients`` answer for a fleet box, from its rendered plan and its API key.

    Refuses (BoxSealed) a box this inventory sealed: its keys are the buyer's, the fleet's no longer opens it.
    """
    from controller.actions.seal import refuse_sealed

    box = fleet.box(box_name)
    refuse_sealed(inventory, box.name, "its API keys are the buyer's (only in the buyer's copy of the report) and "
                  "the fleet's api_key no longer opens it, so there is no key to print")
    return client_config(box, Inventory(inventory).plan(box.name), box_api_key(box), only)

