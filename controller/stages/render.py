"""Render a probe and a plan into an Ansible inventory a person can read and diff.

It writes, through ``controller.inventory.Inventory`` (which owns the folder's layout), each box's
``host_vars/<box>.yml`` (what the roles install on that box), its probe and its plan, and ``hosts.yml``: every box
of the fleet, in groups by OS and (once probed) by GPU shape.

Output is deterministic: the same fleet, profiles and plans give byte-identical files. Secrets are
never written here: ``secrets_for`` names them, and the runner hands them to Ansible in a private file for the
length of a run.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from controller.errors import CatalogError, PlanError
from controller.inventory import Inventory
from controller.inventory import read_rendered as read_rendered  # how a rendered file reads back, beside its writer
from controller.model.clients import role_services
from controller.model.fleet import Box, Connection, Fleet, check_api_key
from controller.model.profile import HardwareProfile
from controller.model.rules import driver_window, is_v100
from controller.model.serveplan import Download, DriverPlan, GatewayPlan, ServePlan, Service

HEADER = "# Rendered by `controller`; edit the fleet file and re-render rather than this file.\n"


# Characters that Jinja's delimiters ({{ }}, {% %}, {# #}) are made of. Text without them (and without
# control characters) cannot be a template, so it is written plain and the files stay easy to read;
# anything else is written as ``!unsafe``.
_TEMPLATE_CHARACTERS = frozenset("{}%#")
# Inventory group names: Ansible's own rule (a Python identifier, lower-case here).
_GROUP_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class _OperatorText(str):
    """A string from the box's ``vars:`` in the fleet file: written as is, so Ansible may template it."""


class _Dumper(yaml.SafeDumper):
    """Block style, no aliases: the output is read by people.

    Ansible evaluates every string of an inventory as a Jinja template on the controller. Probed text
    (GPU names, CPU model, OS strings) and catalog text are data from outside, so each such string
    that could hold a template is tagged ``!unsafe`` and reaches the roles verbatim, never evaluated.
    """

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if data.isprintable() and _TEMPLATE_CHARACTERS.isdisjoint(data):
        return dumper.represent_str(data)
    return dumper.represent_scalar("!unsafe", data)


_Dumper.add_representer(str, _represent_text)
_Dumper.add_representer(_OperatorText, yaml.SafeDumper.represent_str)


def _operator_text(value: Any) -> Any:
    if isinstance(value, str):
        return _OperatorText(value)
    if isinstance(value, dict):
        return {_operator_text(key): _operator_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_operator_text(item) for item in value]
    return value


def _yaml(data: Any, operator_vars: dict[str, Any] | None = None) -> str:
    """``data`` as YAML; the top-level entries that are the box's own ``vars:`` may template on purpose.

    The operator writes ``vars:`` as Ansible variables (like group_vars), so a ``{{ ... }}`` there is
    theirs, and is kept templatable. Everything else is the controller's, the probe's or a catalog's.
    """
    if operator_vars:
        data = {key: _operator_text(value) if key in operator_vars and value is operator_vars[key] else value
                for key, value in data.items()}
    return HEADER + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def connection_vars(box: Connection, known_hosts: Path | None = None) -> dict[str, Any]:
    if box.transport == "local":
        return {"ansible_connection": "local"}
    out: dict[str, Any] = {"ansible_host": box.address, "ansible_port": box.effective_port, "ansible_user": box.user}
    if box.transport == "winrm":
        out |= {
            "ansible_connection": "winrm",
            "ansible_winrm_scheme": box.winrm_scheme,
            "ansible_winrm_transport": box.winrm_transport,
            "ansible_winrm_server_cert_validation": "ignore" if box.winrm_insecure_skip_verify else "validate",
        }
    else:
        if box.key is not None:
            out["ansible_ssh_private_key_file"] = str(box.key.expanduser())
        if known_hosts is not None:
            # Plain `ansible-playbook -i hosts.yml` checks the same recorded keys the controller does.
            out["ansible_ssh_common_args"] = (f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile="
                                              f"{shlex.quote(str(known_hosts))}")
        if box.become and box.user != "root":
            # One rule for boxes and workstations: an account other than root reaches root through sudo.
            out["ansible_become"] = True
    return out


def connection_secrets(machine: Connection, what: str) -> dict[str, Any]:
    """The login password of a box or workstation, which sudo asks for too when the account becomes root."""
    if machine.password is None:
        return {}
    password = machine.password.resolve(f"{what} {machine.name} password")
    out = {"ansible_password": password}
    if machine.transport == "ssh" and machine.become and machine.user != "root":
        out["ansible_become_password"] = password
    return out


def _require_address(box: Box, download: Download) -> str:
    if not download.url:
        raise CatalogError(f"box {box.name}: {download.id} needs a download address; set {download.what} in the fleet "
                           f"file to the folder holding {download.file}")
    return download.url


def _engine_packs(box: Box, plan: ServePlan) -> list[dict[str, Any]]:
    """The engine role's packs; an unpinned pack only from an https mirror, whose SHA256SUMS can be trusted."""
    packs = []
    for engine in plan.engines:
        download = engine.download
        if download is None:
            raise CatalogError(f"box {box.name}: engine {engine.id} has no release pack for {engine.platform}; add one "
                               f"to its entry in a catalog file listed under 'catalogs:'")
        url = _require_address(box, download)
        if not download.sha256 and not url.startswith("https://"):
            # The pack runs as the engine on the box and root unpacks it: a SHA256SUMS file from the same
            # plain-HTTP mirror could be forged along with it.
            raise CatalogError(
                f"box {box.name}: engine {engine.id} has no sha256 pinned for {download.file}, and {download.what} "
                f"({url.rsplit('/', 1)[0]}) is plain HTTP, so its SHA256SUMS cannot be trusted; pin the pack: copy "
                f"the entry engines.{engine.id} of the built-in engines.yml into a catalog file listed under "
                f"'catalogs:' and add sha256: <64 hex digits> to packs.{engine.platform} (sha256sum "
                f"{download.file}), or serve the mirror over https"
            )
        packs.append({"name": engine.slot, "version": engine.commit, "url": url, "sha256": download.sha256 or "",
                      "sha256sums_url": download.sha256sums_url or "", "nccl": engine.nccl}
                     | ({"fallback_url": download.fallback_url} if download.fallback_url else {}))
    return packs


def _pinned_download(box: Box, download: Download | None, what: str) -> dict[str, Any]:
    """A file that runs with full rights on the box (the driver installer, WinSW): only when pinned."""
    if download is None:
        raise CatalogError(f"box {box.name}: the catalog has no {what}; add it under 'downloads:' in a catalog file")
    url = _require_address(box, download)
    if not download.sha256:
        raise CatalogError(
            f"{download.id}: no sha256 pinned for {download.file}; it runs with full rights on the box, so it is only "
            f"installed when pinned. Hash the file you trust (PowerShell: Get-FileHash -Algorithm SHA256 "
            f"{download.file}) and add it to a catalog file listed under 'catalogs:' in the fleet file:\n"
            f"  downloads:\n    {download.id}:\n      sha256: <64 hex digits>")
    return {"version": download.version, "url": url, "sha256": download.sha256}


def _model_files(box: Box, plan: ServePlan) -> list[dict[str, Any]]:
    files = []
    for model in plan.models:
        if not model.sha256:
            raise CatalogError(
                f"model {model.id}: no sha256 pinned; add it to a catalog file listed under 'catalogs:' in the "
                f"fleet file (the hub shows each file's SHA256 on its page)"
            )
        if not model.url:
            raise CatalogError(f"model {model.id}: no download address; set mirror.models in the fleet file")
        if model.token and not model.url.startswith("https://"):
            raise CatalogError(
                f"box {box.name}: mirror.models_token would send hf_token to {box.mirror.models}, which is plain "
                f"HTTP; serve the models mirror over https or remove models_token"
            )
        files.append({"name": model.file, "url": model.url, "sha256": model.sha256, "size": model.size_bytes}
                     | ({"token": True} if model.token else {})
                     | ({"fallback_url": model.fallback_url} if model.fallback_url else {}))
    return files


def uses_nccl(plan: ServePlan) -> bool:
    """A tensor-split service on an NVLink board all-reduces through NCCL."""
    return any(service.nccl for service in plan.services)


def _gpus(profile: HardwareProfile) -> list[dict[str, Any]]:
    return [{"index": gpu.index, "name": gpu.name, "pci_bus_id": gpu.pci_bus_id, "is_v100": is_v100(gpu.name),
             "driver_model": profile.driver.model}
            | ({"uuid": gpu.uuid} if gpu.uuid else {})
            | ({"minor_number": gpu.minor_number} if gpu.minor_number is not None else {})
            for gpu in profile.gpus]


def _on_demand(service: Service) -> dict[str, Any]:
    """A router's models: the preset the role writes (a section per model) and how the key reaches them."""
    if service.on_demand is None:
        return {}
    on_demand = service.on_demand
    return {"models": service.models, "on_demand": {
        "preset_file": on_demand.preset_file, "key_file_env": on_demand.key_file_env,
        "max_loaded": on_demand.max_loaded,
        "models": [{"id": item.id, "preset": item.preset} for item in on_demand.models]}}


def _sandbox(box: Box, service: Service) -> dict[str, Any]:
    """The unit's device nodes (by minor number; none for a CPU service) and W^X memory, as the plan decided."""
    if box.os != "linux":
        return {}
    return {"gpu_minors": service.gpu_minors, "memory_deny_write_execute": service.memory_deny_write_execute}


def driver_vars(box: Box, profile: HardwareProfile, driver: DriverPlan) -> dict[str, Any]:
    """The driver role's inputs: the probed GPUs, the window, reboot, and per OS the branch or the installer."""
    out: dict[str, Any] = {
        "nvidia_driver_manage": driver.manage,
        "nvidia_driver_gpus": _gpus(profile),
        "nvidia_driver_window": driver_window(),
        "nvidia_driver_allow_reboot": driver.allow_reboot,
    }
    if box.os == "windows":
        out["nvidia_driver_mode"] = driver.mode
        if driver.installs:
            out["nvidia_driver_installer"] = _pinned_download(box, driver.installer, "Windows driver installer")
        return out
    out |= {"nvidia_driver_branch": driver.branch, "nvidia_driver_nccl": driver.nccl}
    if box.mirror.drivers:
        out["nvidia_driver_repo_url"] = box.mirror.drivers
        out["nvidia_driver_repo_key_url"] = box.mirror.drivers_key or ""
        out["nvidia_driver_repo_key_fingerprint"] = box.mirror.drivers_key_fingerprint or ""
        out["nvidia_driver_repo_trusted"] = box.mirror.drivers_trusted
    return out


def cache_vars(box: Box) -> dict[str, Any]:
    """The fleet's LAN cache: on its host, roles/lan_cache's server; on every Linux box, the download roles' check.

    The download roles ask the cache's health URL first; when it does not answer they fetch each file's
    fallback_url (present only when the fleet allows it) or stop naming the cache host.
    """
    cache = box.mirror.cache
    if cache is None or box.os != "linux":
        return {}
    check = {"host": cache.host, "health_url": cache.health_url}
    out: dict[str, Any] = {}
    if cache.models:
        out["gguf_model_cache"] = check
    if cache.engines:
        out["llama_engine_cache"] = check
    if cache.serve is not None:
        out |= {
            "lan_cache_serve": True,
            "lan_cache_bind": cache.serve.bind,
            "lan_cache_port": cache.serve.port,
            "lan_cache_allow_from": cache.serve.allow_from,
            "lan_cache_upstreams": {kind: base for kind, base in (("models", cache.models),
                                                                  ("engines", cache.engines)) if base},
        }
    return out


def host_vars(box: Box, profile: HardwareProfile, plan: ServePlan | None, driver: DriverPlan | None = None,
              ) -> dict[str, Any]:
    """What the roles need on this box, projected from the plan; without services, the driver role's inputs.

    One builder for both OSes: the roles take the same variables on Linux and Windows, and the few that
    exist only on Windows (the driver installer and mode, WinSW) are added for Windows boxes.
    """
    driver = driver or (plan.driver if plan is not None else None)
    if driver is None:
        raise PlanError(f"box {box.name}: the plan has no driver decision; plan the box again")
    linux = {"ansible_python_interpreter": "/usr/bin/python3"} if box.os == "linux" else {}
    if plan is None:
        return {**linux, **driver_vars(box, profile, driver), **cache_vars(box), **box.vars}
    if not plan.services:
        raise PlanError(f"box {box.name}: the plan places no service; nothing to provision")
    slots = {engine.id: engine for engine in plan.engines}
    merged = {
        **linux,
        **driver_vars(box, profile, driver),
        "llama_engine_packs": _engine_packs(box, plan),
        "gguf_model_dir": plan.model_dir,
        "gguf_model_files": _model_files(box, plan),
        **cache_vars(box),
        "llama_service_bind": box.bind,
        "llama_service_allow_from": box.allow_from,
        "llama_service_instances": [
            {
                "name": service.name,
                "model": service.model,
                "engine": slots[service.engine].slot,
                "version": slots[service.engine].commit,
                "port": service.port,
                "args": service.args,
                "env": service.env,
                "mlock": service.mlock,
                "nccl": service.nccl,
                "api_key_flag": slots[service.engine].api_key_flag,
                "no_slots_flags": slots[service.engine].no_slots_flags,
                **_sandbox(box, service),
                **_on_demand(service),
            }
            for service in plan.services
        ],
        "llama_service_templates": sorted(plan.templates()),
        "llama_service_template_dir": plan.template_dir,
        "agent_clients_services": role_services(box, plan),
        "llama_verify_nccl": uses_nccl(plan),
        **thermal_vars(box, plan),
    }
    archs = sorted({arch for engine in plan.engines for arch in engine.cuda_archs})
    if archs:  # a source build (llama_engine_source) targets the architectures of the plan's GPU builds
        merged["llama_engine_cuda_architectures"] = archs
    if box.os == "windows":
        merged["llama_service_winsw"] = _pinned_download(box, plan.service_wrapper, "WinSW service wrapper")
    else:
        merged |= gateway_vars(plan.gateway)
    merged |= box.vars
    check_exposure(box, merged)
    return merged


def guard_enabled(box: Box, plan: ServePlan) -> bool:
    """Whether the box runs the thermal guard: as the fleet says, or (unset) when a service runs on a GPU."""
    return box.thermal.guard if box.thermal.guard is not None else any(service.gpus for service in plan.services)


def thermal_vars(box: Box, plan: ServePlan) -> dict[str, Any]:
    """roles/thermal_guard's inputs: the guard (unset in the fleet: on when a service runs on a GPU) and power limits.

    The guard manages the plan's llama services by their service names; the card's power range is checked on the box.
    """
    thermal = box.thermal
    guard = guard_enabled(box, plan)
    out: dict[str, Any] = {"thermal_guard_enabled": guard}
    if guard:
        suffix = "" if box.os == "windows" else ".service"
        out |= {
            "thermal_guard_services": [f"{service.name}{suffix}" for service in plan.services],
            "thermal_guard_warn_c": thermal.warn_c,
            "thermal_guard_stop_c": thermal.stop_c,
            "thermal_guard_resume_c": thermal.resume_c,
            "thermal_guard_memory_warn_c": thermal.memory_warn_c,
            "thermal_guard_memory_stop_c": thermal.memory_stop_c,
            "thermal_guard_interval_s": thermal.interval_s,
            "thermal_guard_max_restarts": thermal.max_restarts,
        }
    if box.power_limit_w is not None:
        out["thermal_guard_power_limit_w"] = box.power_limit_w
    return out


def gateway_vars(gateway: GatewayPlan | None) -> dict[str, Any]:
    """roles/llm_gateway's inputs; without them (its default: no routes) the role removes a gateway it installed."""
    if gateway is None:
        return {}
    return {
        "llm_gateway_bind": gateway.bind,
        "llm_gateway_port": gateway.port,
        "llm_gateway_metrics_port": gateway.metrics_port,
        "llm_gateway_allow_from": gateway.allow_from,
        "llm_gateway_buffer_bytes": gateway.buffer_bytes,
        "llm_gateway_connect_timeout_ms": gateway.connect_timeout_ms,
        "llm_gateway_idle_timeout_s": gateway.idle_timeout_s,
        "llm_gateway_routes": [route.model_dump(mode="json") for route in gateway.routes],
    }


def _bound_hosts(instance: dict[str, Any]) -> list[str]:
    """The addresses an instance's own arguments or environment tell the server to bind."""
    args = [str(arg) for arg in instance.get("args") or []]
    hosts = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--host"]
    hosts += [arg.removeprefix("--host=") for arg in args if arg.startswith("--host=")]
    env_host = (instance.get("env") or {}).get("LLAMA_ARG_HOST")
    return hosts + ([str(env_host)] if env_host else [])


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def check_exposure(box: Box, merged: dict[str, Any]) -> None:
    """Refuse host_vars whose servers would really bind beyond loopback without a key and allowed networks.

    The server binds what ``--host`` in its arguments says, and the box's ``vars:`` are merged last, so
    the check runs on the merged result: every instance's ``--host`` must be the bind address the role
    checks (llama_service_bind), and an address beyond loopback needs an API key and allow_from.
    """
    bind = str(merged.get("llama_service_bind", box.bind))
    for instance in merged.get("llama_service_instances") or []:
        for host in _bound_hosts(instance):
            if host != bind:
                raise PlanError(
                    f"box {box.name}: instance {instance.get('name')} would bind {host} (its --host), but "
                    f"llama_service_bind is {bind}; set the address once, with bind in the fleet file, "
                    f"and drop --host/llama_service_bind from the box's vars")
    if _loopback(bind):
        return
    if box.api_key is None and not merged.get("llama_service_api_key"):
        raise PlanError(f"box {box.name}: its servers would bind {bind}, which other machines can reach, without "
                        f"an API key; set api_key in the fleet file, or bind 127.0.0.1")
    if not box.allow_from and not merged.get("llama_service_allow_from"):
        raise PlanError(f"box {box.name}: its servers would bind {bind}, which other machines can reach; list the "
                        f"networks that may connect in allow_from in the fleet file (e.g. [192.168.1.0/24]), "
                        f"or bind 127.0.0.1")


def secrets_for(box: Box, fleet: Fleet | None = None) -> dict[str, Any]:
    """The playbook variables that carry the box's secrets (handed to each run, never rendered).

    With the fleet, a box with a gateway also gets the gateway's key and the keys of the other boxes it
    routes to (their servers ask for them).
    """
    secrets: dict[str, Any] = {}
    if box.gateway is not None and box.os == "linux":
        what = f"box {box.name} gateway.api_key"
        secrets["llm_gateway_api_key"] = check_api_key(box.gateway.api_key.resolve(what), what)
        if fleet is not None:
            secrets["llm_gateway_box_keys"] = {
                name: check_api_key(fleet.boxes[name].api_key.resolve(f"box {name} api_key"), f"box {name} api_key")
                for name in box.gateway.boxes if name != box.name and fleet.boxes[name].api_key is not None}
    if box.api_key is not None:
        what = f"box {box.name} api_key"
        secrets["llama_service_api_key"] = check_api_key(box.api_key.resolve(what), what)
    if box.hf_token is not None and box.os == "linux":  # Windows boxes download models from a mirror
        secrets["gguf_model_hf_token"] = box.hf_token.resolve(f"box {box.name} hf_token")
    return secrets | connection_secrets(box, "box")


def hosts_yml(fleet: Fleet, profiles: dict[str, HardwareProfile], known_hosts: Path | None = None) -> dict[str, Any]:
    from controller.stages.probe.groups import group_names

    groups: dict[str, dict[str, Any]] = {}
    for name in sorted(fleet.boxes):
        box = fleet.boxes[name]
        names = group_names(profiles[name]) if name in profiles else [box.os]
        names = [group for group in names if _GROUP_NAME.match(group)]  # derived from probes: keep them plain
        for group in sorted(set(names) | {box.os}):
            groups.setdefault(group, {"hosts": {}})["hosts"][name] = connection_vars(box, known_hosts) if group == box.os else {}
    for group, members in sorted(fleet.groups.items()):  # the fleet's own groups, for --limit GROUP
        for name in sorted(members):
            groups.setdefault(group, {"hosts": {}})["hosts"].setdefault(name, {})
    return {"all": {"children": {group: groups[group] for group in sorted(groups)}}}


def render_box(inventory: Path, fleet: Fleet, box: Box, profile: HardwareProfile, plan: ServePlan | None,
               driver: DriverPlan | None = None) -> list[Path]:
    """Write this box's probe, plan and host_vars, then hosts.yml for the whole fleet.

    Without a plan (a box that names no model yet) only the driver role's inputs are written, from
    ``driver``, and a plan left from an earlier render is removed, so the inventory never describes
    services the box will not get.
    """
    folder = Inventory(inventory)
    host_vars_text = _yaml({k: v for k, v in host_vars(box, profile, plan, driver).items() if v is not None},
                           box.vars)
    written = [folder.write_probe(box.name, profile)]
    if plan is not None:
        written.append(folder.write_plan(box.name, plan))
    else:
        folder.remove_plan(box.name)
    written.append(folder.write_host_vars(box.name, host_vars_text))
    known_hosts = Inventory(inventory.resolve()).known_hosts_file
    written.append(folder.write_hosts(_yaml(hosts_yml(fleet, folder.probes(), known_hosts))))
    return written
