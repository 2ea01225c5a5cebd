"""Render a probe and a plan into an Ansible inventory a person can read and diff.

Layout of the inventory folder::

    hosts.yml               every box of the fleet, in groups by OS and (once probed) by GPU shape
    host_vars/<box>.yml     what the roles install on that box
    probes/<box>.json       the hardware profile the groups and the plan came from
    plans/<box>.json        the serving plan, with its reasons

Output is deterministic: the same fleet, profiles and plans give byte-identical files. Secrets are
never written here; the runner hands them to Ansible in a private file for the length of a run.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from controller.catalog import Catalog
from controller.errors import CatalogError, PlanError
from controller.files import write_atomic
from controller.fleet import Box, Fleet
from controller.probe.driver import WINDOWS_DRIVER
from controller.profile import HardwareProfile
from controller.serveplan import ServePlan
from controller.transports.known_hosts import known_hosts_file

HEADER = "# Rendered by `controller`; edit the fleet file and re-render rather than this file.\n"
WINSW = "winsw-2.12.0"
LINUX_PLATFORM = "linux-x86_64"
WINDOWS_PLATFORM = "windows-x86_64"


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


class RenderedLoader(yaml.SafeLoader):
    """Reads what ``_yaml`` wrote, ``!unsafe`` strings included (as plain strings), without Ansible."""


RenderedLoader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


def read_rendered(text: str) -> Any:
    """A rendered inventory file as data: the values Ansible sees, none of them evaluated."""
    return yaml.load(text, Loader=RenderedLoader)  # noqa: S506 - a SafeLoader subclass


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


def connection_vars(box: Box, known_hosts: Path | None = None) -> dict[str, Any]:
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
    return out


def _engine_packs(box: Box, plan: ServePlan, catalog: Catalog, platform: str) -> dict[str, dict[str, Any]]:
    engines: dict[str, dict[str, Any]] = {}
    for service in plan.services:
        engine = catalog.engine(service.engine)
        if engine.id in engines:
            continue
        pack = engine.pack(platform)
        if not box.mirror.engines:
            raise CatalogError(
                f"box {box.name}: engine {engine.id} needs a download address; set mirror.engines in the "
                f"fleet file to the folder holding {pack.file} and its SHA256SUMS"
            )
        base = box.mirror.engines.rstrip("/")
        if not pack.sha256 and not base.startswith("https://"):
            # The pack runs as the engine on the box and root unpacks it: a SHA256SUMS file from the same
            # plain-HTTP mirror could be forged along with it.
            raise CatalogError(
                f"box {box.name}: engine {engine.id} has no sha256 pinned for {pack.file}, and mirror.engines "
                f"({base}) is plain HTTP, so its SHA256SUMS cannot be trusted; pin the pack: copy the entry "
                f"engines.{engine.id} of the built-in engines.yml into a catalog file listed under 'catalogs:' "
                f"and add sha256: <64 hex digits> to packs.{platform} (sha256sum {pack.file}), or serve the "
                f"mirror over https"
            )
        engines[engine.id] = {
            "name": engine.slot,
            "version": engine.commit,
            "url": f"{base}/{pack.file}",
            "sha256": pack.sha256 or "",
            "sha256sums_url": "" if pack.sha256 else f"{base}/SHA256SUMS",
        }
    return engines


def _model_files(box: Box, plan: ServePlan, catalog: Catalog) -> list[dict[str, Any]]:
    # The hub token goes to huggingface.co (the role's default); to the models mirror only when the fleet
    # says so, and only over https. Windows boxes get no token at all.
    mirror_token = box.os == "linux" and box.mirror.models_token and bool(box.mirror.models)
    if mirror_token and not str(box.mirror.models).startswith("https://"):
        raise CatalogError(
            f"box {box.name}: mirror.models_token would send hf_token to {box.mirror.models}, which is plain HTTP; "
            f"serve the models mirror over https or remove models_token"
        )
    models: dict[str, dict[str, Any]] = {}
    for service in plan.services:
        model = catalog.model(service.model)
        if not model.sha256:
            raise CatalogError(
                f"model {model.id}: no sha256 pinned; add it to a catalog file listed under 'catalogs:' in the "
                f"fleet file (the hub shows each file's SHA256 on its page)"
            )
        models.setdefault(model.file, {
            "name": model.file,
            "url": model.url(box.mirror.models),
            "sha256": model.sha256,
            "size": model.size_bytes,
        } | ({"token": True} if mirror_token else {}))
    return list(models.values())


def uses_nccl(plan: ServePlan) -> bool:
    """A tensor-split service on an NVLink board all-reduces through NCCL."""
    return any(service.env.get("GGML_CUDA_ALLREDUCE") == "nccl" for service in plan.services)


def _gpus(profile: HardwareProfile, *, windows: bool = False) -> list[dict[str, Any]]:
    out = []
    for gpu in profile.gpus:
        entry: dict[str, Any] = {"index": gpu.index, "name": gpu.name, "pci_bus_id": gpu.pci_bus_id}
        if windows:
            entry["driver_model"] = profile.driver.model
        out.append(entry)
    return out


def driver_vars(box: Box, profile: HardwareProfile, catalog: Catalog, *, nccl: bool = False) -> dict[str, Any]:
    """What the driver role of the box's OS needs: the probed GPUs, the branch, the mirror, reboot and NCCL."""
    if box.os == "windows":
        out: dict[str, Any] = {
            "win_nvidia_driver_manage": box.driver.manage,
            "win_nvidia_driver_gpus": _gpus(profile, windows=True),
            "win_nvidia_driver_mode": "mcdm" if box.driver.wsl2 else "tcc",
            "win_nvidia_driver_allow_reboot": box.driver.allow_reboot,
        }
        if box.driver.manage and any(gpu.is_v100 for gpu in profile.gpus):
            installer = catalog.download(f"nvidia-windows-{WINDOWS_DRIVER}")
            url, sha256 = installer.source(box.mirror.drivers, "mirror.drivers")
            out |= {"win_nvidia_driver_version": installer.version, "win_nvidia_driver_url": url,
                    "win_nvidia_driver_sha256": sha256}
        return out
    out = {
        "nvidia_driver_manage": box.driver.manage,
        "nvidia_driver_gpus": _gpus(profile),
        "nvidia_driver_branch": box.driver.branch,
        "nvidia_driver_allow_reboot": box.driver.allow_reboot,
        "nvidia_driver_nccl": nccl,
    }
    if box.mirror.drivers:
        out["nvidia_driver_repo_url"] = box.mirror.drivers
        out["nvidia_driver_repo_key_url"] = box.mirror.drivers_key or ""
        out["nvidia_driver_repo_key_fingerprint"] = box.mirror.drivers_key_fingerprint or ""
        out["nvidia_driver_repo_trusted"] = box.mirror.drivers_trusted
    return out


def host_vars(box: Box, plan: ServePlan | None, catalog: Catalog, profile: HardwareProfile | None = None,
              ) -> dict[str, Any]:
    """What the roles need to install and run the plan on this box; without a plan, the driver role's inputs."""
    profile = profile or HardwareProfile()
    linux = {"ansible_python_interpreter": "/usr/bin/python3"} if box.os == "linux" else {}
    if plan is None:
        return {**linux, **driver_vars(box, profile, catalog), **box.vars}
    if not plan.services:
        raise PlanError(f"box {box.name}: the plan places no service; nothing to provision")
    if box.os == "windows":
        merged = {**_windows_host_vars(box, plan, catalog, profile), **box.vars}
        check_exposure(box, merged)
        return merged
    engines = _engine_packs(box, plan, catalog, LINUX_PLATFORM)
    nccl = uses_nccl(plan)
    merged = {
        **linux,
        **driver_vars(box, profile, catalog, nccl=nccl),
        "llama_engine_packs": list(engines.values()),
        "gguf_model_dir": box.effective_model_dir,
        "gguf_model_files": _model_files(box, plan, catalog),
        "llama_service_bind": box.bind,
        "llama_service_instances": [
            {
                "name": service.name,
                "model": service.model,
                "engine": catalog.engine(service.engine).slot,
                "port": service.port,
                "args": service.args,
                "env": service.env,
                "mlock": "--mlock" in service.args or "mlock" in service.args,
                "api_key_flag": catalog.engine(service.engine).api_key.file_flag,
                "no_slots_flags": catalog.engine(service.engine).no_slots_flags,
            }
            for service in plan.services
        ],
        "llama_service_allow_from": box.allow_from,
        "llama_service_templates": sorted({s.template for s in plan.services if s.template}),
        "llama_verify_nccl": nccl,
        **box.vars,
    }
    check_exposure(box, merged)
    return merged


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
    prefix = "win_" if box.os == "windows" else ""
    bind = str(merged.get(f"{prefix}llama_service_bind", box.bind))
    for instance in merged.get(f"{prefix}llama_service_instances") or []:
        for host in _bound_hosts(instance):
            if host != bind:
                raise PlanError(
                    f"box {box.name}: instance {instance.get('name')} would bind {host} (its --host), but "
                    f"{prefix}llama_service_bind is {bind}; set the address once, with bind in the fleet file, "
                    f"and drop --host/{prefix}llama_service_bind from the box's vars")
    if _loopback(bind):
        return
    if box.api_key is None and not merged.get(f"{prefix}llama_service_api_key"):
        raise PlanError(f"box {box.name}: its servers would bind {bind}, which other machines can reach, without "
                        f"an API key; set api_key in the fleet file, or bind 127.0.0.1")
    if not box.allow_from and not merged.get(f"{prefix}llama_service_allow_from"):
        raise PlanError(f"box {box.name}: its servers would bind {bind}, which other machines can reach; list the "
                        f"networks that may connect in allow_from in the fleet file (e.g. [192.168.1.0/24]), "
                        f"or bind 127.0.0.1")


def _windows_host_vars(box: Box, plan: ServePlan, catalog: Catalog, profile: HardwareProfile) -> dict[str, Any]:
    """The same plan for the win_* roles: zip packs, WinSW services, the driver installer."""
    engines = _engine_packs(box, plan, catalog, WINDOWS_PLATFORM)
    nccl = uses_nccl(plan)
    for service in plan.services:
        engine = catalog.engine(service.engine)
        engines[engine.id]["nccl"] = engine.nccl
    driver = driver_vars(box, profile, catalog)
    winsw = catalog.download(WINSW)
    winsw_url, winsw_sha256 = winsw.source(box.mirror.engines, "mirror.engines")
    return driver | {
        "win_llama_engine_packs": list(engines.values()),
        "win_gguf_model_dir": box.effective_model_dir,
        "win_gguf_model_files": _model_files(box, plan, catalog),
        "win_llama_service_bind": box.bind,
        "win_llama_service_allow_from": box.allow_from,
        "win_llama_service_winsw": {"version": winsw.version, "url": winsw_url, "sha256": winsw_sha256},
        "win_llama_service_instances": [
            {
                "name": service.name,
                "model": service.model,
                "engine": catalog.engine(service.engine).slot,
                "version": catalog.engine(service.engine).commit,
                "port": service.port,
                "args": service.args,
                "env": service.env,
            }
            for service in plan.services
        ],
        "win_llama_service_templates": sorted({s.template for s in plan.services if s.template}),
        "win_llama_verify_nccl": nccl,
    }


def hosts_yml(fleet: Fleet, profiles: dict[str, HardwareProfile], known_hosts: Path | None = None) -> dict[str, Any]:
    from controller.probe.groups import group_names

    groups: dict[str, dict[str, Any]] = {}
    for name in sorted(fleet.boxes):
        box = fleet.boxes[name]
        names = group_names(profiles[name]) if name in profiles else [box.os]
        names = [group for group in names if _GROUP_NAME.match(group)]  # derived from probes: keep them plain
        for group in sorted(set(names) | {box.os}):
            groups.setdefault(group, {"hosts": {}})["hosts"][name] = connection_vars(box, known_hosts) if group == box.os else {}
    return {"all": {"children": {group: groups[group] for group in sorted(groups)}}}


def load_profiles(inventory: Path) -> dict[str, HardwareProfile]:
    """The saved probes of the inventory's boxes; an unreadable one is left out with a warning.

    One box's damaged artefact must not stop the render of another: the box it belongs to keeps only
    its OS group in hosts.yml until it is probed again.
    """
    profiles = {}
    for path in sorted((inventory / "probes").glob("*.json")):
        try:
            profiles[path.stem] = HardwareProfile.model_validate_json(path.read_bytes())
        except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            reason = getattr(exc, "strerror", None) or "not a `controller probe --json` profile"
            print(f"warning: {path}: {reason}; {path.stem} keeps only its OS group in hosts.yml until "
                  f"`controller render {path.stem}` probes it again", file=sys.stderr)
    return profiles


def render_box(inventory: Path, fleet: Fleet, box: Box, profile: HardwareProfile, plan: ServePlan | None,
               catalog: Catalog) -> list[Path]:
    """Write this box's probe, plan and host_vars, then hosts.yml for the whole fleet.

    Without a plan (a box that names no model yet) only the driver role's inputs are written, and a plan
    left from an earlier render is removed, so the inventory never describes services the box will not get.
    """
    plan_path = inventory / "plans" / f"{box.name}.json"
    files = {inventory / "probes" / f"{box.name}.json": json.dumps(profile.model_dump(mode="json"), indent=2) + "\n"}
    if plan is not None:
        files[plan_path] = json.dumps(plan.model_dump(mode="json"), indent=2) + "\n"
    files[inventory / "host_vars" / f"{box.name}.yml"] = _yaml(
        {k: v for k, v in host_vars(box, plan, catalog, profile).items() if v is not None}, box.vars)
    if plan is None:
        plan_path.unlink(missing_ok=True)
    written = []
    for path, text in files.items():
        write_atomic(path, text)
        written.append(path)
    hosts = inventory / "hosts.yml"
    write_atomic(hosts, _yaml(hosts_yml(fleet, load_profiles(inventory), known_hosts_file(inventory.resolve()))))
    written.append(hosts)
    return written
