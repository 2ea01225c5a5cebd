"""Wire a workstation's accounts to boxes of the fleet: render its inventory, run playbooks/clients.yml.

A workstation (the fleet's ``workstations:``) gets what ``controller clients`` prints for each box it names,
written by roles/agent_clients: a Claude Code launch script per model, a copy of each box's key readable by the
account only, and the boxes merged as providers into its OpenClaw config. The values come from the boxes'
rendered plans (``controller provision BOX`` first); the keys from the fleet file's ``api_key`` of each box,
handed to the run as secrets, never written into the inventory::

    workstations.yml          the fleet's workstations and how to reach them (boxes stay in hosts.yml)
    host_vars/<name>.yml      the services to wire and the accounts, without keys
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from controller.actions.clients import box_api_key
from controller.errors import FleetError
from controller.inventory import Inventory
from controller.model.clients import role_services
from controller.model.fleet import Fleet, Workstation
from controller.stages.render import _yaml, connection_secrets, connection_vars
from controller.stages.runner import EventHandler, RunResult, run_playbook

GROUP = "workstations"


def script_name(model: str) -> str:
    """The launch script's name on Linux (roles/agent_clients spells it the same)."""
    return "claude-" + re.sub(r"[^A-Za-z0-9._-]", "_", model)


def workstation_vars(fleet: Fleet, station: Workstation, inventory: Path) -> dict[str, Any]:
    """roles/agent_clients' inputs for a workstation, from the rendered plans of its boxes; no key in them."""
    services: list[dict[str, Any]] = []
    scripts: dict[str, str] = {}
    for name in station.boxes:
        box = fleet.box(name)
        for service in role_services(box, Inventory(inventory).plan(box.name), key=box.name):
            script = script_name(service["model"])
            if script in scripts:
                raise FleetError(f"workstation {station.name}: boxes {scripts[script]} and {name} both serve "
                                 f"{service['model']}, so both would get the launch script {script}; name one of "
                                 f"them in its boxes")
            scripts[script] = name
            services.append(service)
    linux = {"ansible_python_interpreter": "/usr/bin/python3"} if station.os == "linux" else {}
    return {**linux, "agent_clients_services": services, "agent_clients_users": station.wired_accounts,
            "agent_clients_openclaw": station.openclaw}


def workstation_secrets(fleet: Fleet, station: Workstation) -> dict[str, Any]:
    """The run's secrets: each named box's API key (by box name), and the login password when there is one."""
    secrets: dict[str, Any] = {"agent_clients_keys": {name: box_api_key(fleet.box(name)) for name in station.boxes}}
    secrets |= connection_secrets(station, "workstation")
    return secrets


def hosts_yml(fleet: Fleet, known_hosts: Path | None = None) -> dict[str, Any]:
    hosts = {name: connection_vars(station, known_hosts) for name, station in sorted(fleet.workstations.items())}
    return {"all": {"children": {GROUP: {"hosts": hosts}}}}


def render_workstation(inventory: Path, fleet: Fleet, station: Workstation) -> list[Path]:
    """Write the workstation's host_vars and workstations.yml (every workstation of the fleet)."""
    folder = Inventory(inventory)
    host_vars = _yaml(workstation_vars(fleet, station, inventory))  # refuses a box without a plan before any write
    return [folder.write_host_vars(station.name, host_vars),
            folder.write_workstations(_yaml(hosts_yml(fleet, Inventory(inventory.resolve()).known_hosts_file)))]


def _record_host_key(station: Workstation, inventory: Path) -> None:
    """First contact over SSH, as the probe makes with a box: the host key is checked, or recorded (trust on first
    use, said out loud), in the inventory's known_hosts, which Ansible then checks strictly."""
    if station.transport != "ssh":
        return
    from controller.stages.transports import open_transport

    transport = open_transport(station, known_hosts=Inventory(inventory).known_hosts_file)  # type: ignore[arg-type]
    try:
        transport.run("true")
    finally:
        transport.close()


def provision_workstation(fleet: Fleet, name: str, inventory: Path, on_event: EventHandler | None = None,
                          ) -> tuple[dict[str, Any], RunResult]:
    """Render the workstation's inventory and run playbooks/clients.yml on it; the answer says what was wired."""
    station = fleet.workstation(name)
    if station.os == "windows":
        raise FleetError(f"workstation {name}: Windows workstations are not wired yet; run `controller clients BOX` "
                         f"and paste its environment, or use the box's own claude-<model>.ps1")
    secrets = workstation_secrets(fleet, station)  # unreadable secrets refuse before anything is written
    folder = Inventory(inventory)
    with folder.mutex(f"clients {name}"):
        render_workstation(inventory, fleet, station)
        _record_host_key(station, inventory)
        result = run_playbook("clients.yml", inventory=inventory, limit=name, secrets=secrets, on_event=on_event,
                              hosts_file=folder.workstations_file)
    services = workstation_vars(fleet, station, inventory)["agent_clients_services"]
    report = {"workstation": name, "accounts": station.wired_accounts,
              "services": [{"box": service["box"], "model": service["model"],
                            "base_url": service["env"]["ANTHROPIC_BASE_URL"], "script": script_name(service["model"])}
                           for service in services]}
    return report, result

