"""What a box's certification found, check by check. Pure: from what ``playbooks/certify.yml`` answered, the
box's fresh probe, its rendered plan, the catalog's throughput bands and its lock entry.

Each check is ``{name, section, passed, detail}`` (the ``checks`` of ``controller certify --json``); what could not
be checked is ``{name, why}`` in ``not_checked``, never a silent pass. ``controller/actions/certify.py`` runs the play
and writes the report; ``controller/reports/certify.py`` formats it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controller.model.catalog import Catalog, ThroughputBand
from controller.model.fleet import Box
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan, Service
from controller.stages.runner import RunResult
from controller.stages.verify.status import box_status
from controller.stages.verify.verdict import check_service, expects_key

STATS_KEY = "llama_certify"  # the set_stats key of roles/llama_verify tasks/certify.yml
GUARD_UNIT = "v100box-thermal-guard"
POWER_UNIT = "v100box-power-limit"
GPU_MEMORY = "GPU memory vs plan"  # the report's section, and its name in not_checked
# Throttle reasons that slow a card down because of heat or power (idle and application clocks do not).
HEAT_OR_POWER = {"sw_thermal", "hw_thermal", "hw_slowdown", "sw_power_cap", "hw_power_brake"}


def check(name: str, section: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "section": section, "passed": bool(passed), "detail": detail}


def band_for(service: Service, profile: HardwareProfile, bands: Iterable[ThroughputBand]) -> ThroughputBand | None:
    """The first band that describes how ``service`` runs on this box (cards, offload, split, driver model)."""
    mode = profile.driver.model
    for band in bands:
        if band.gpus != len(service.gpus) or band.offload != service.cpu_offload:
            continue
        if band.gpus > 1 and band.split != service.split_mode:
            continue
        # A Linux box reports no driver model: it runs the cards natively, as TCC does on Windows.
        if band.driver_model == mode or {band.driver_model, mode} <= {None, "TCC"}:
            return band
    return None


def likely_causes(service: Service, profile: HardwareProfile, burn_in: Mapping[str, Any] | None,
                  power: Mapping[str, Any] | None) -> list[str]:
    """Why a service may run below its band, from what was seen on this box; the usual suspects when nothing was."""
    causes = []
    gpus = set(service.gpus)
    reasons: dict[str, int] = {}
    for sample in (burn_in or {}).get("samples") or []:
        for gpu in sample.get("gpus") or []:
            if gpu.get("index") in gpus:
                for reason in set(gpu.get("throttle") or []) & HEAT_OR_POWER:
                    reasons[reason] = reasons.get(reason, 0) + 1
    if any("thermal" in reason or reason == "hw_slowdown" for reason in reasons):
        causes.append("thermal throttling: " + ", ".join(f"{r} in {n} samples" for r, n in sorted(reasons.items())
                                                         if "thermal" in r or r == "hw_slowdown"))
    if {"sw_power_cap", "hw_power_brake"} & set(reasons):
        causes.append("power capping (sw_power_cap/hw_power_brake seen): the power limit or the supply holds the "
                      "cards back")
    if profile.driver.model in ("MCDM", "WDDM"):
        causes.append(f"the driver runs the cards in {profile.driver.model} mode, not TCC (decode is up to 76% faster "
                      "in TCC: serve from native Windows)")
    for limit in (power or {}).get("limits") or []:
        if limit.get("gpu") in gpus and limit.get("watts"):
            causes.append(f"GPU {limit['gpu']} runs at a {limit['watts']} W power limit set in the fleet file")
    for warning in profile.warnings:
        if "PCIe" in warning or "link" in warning.lower():
            causes.append(warning)
    if not causes:
        causes.append("nothing seen in this run; the usual causes are thermal throttling (run with --burn-in to "
                      "sample), MCDM instead of TCC, a PCIe link trained below its width, a low power limit")
    return causes


def throughput_row(service: Service, answers: Mapping[str, Any], profile: HardwareProfile, catalog: Catalog,
                   burn_in: Mapping[str, Any] | None, power: Mapping[str, Any] | None) -> dict[str, Any]:
    measured = (answers.get(service.name) or {}).get("throughput") or {}
    gen, prompt = measured.get("predicted_per_second"), measured.get("prompt_per_second")
    band = band_for(service, profile, catalog.model(service.model).throughput)
    row: dict[str, Any] = {"service": service.name, "model": service.model, "gen_tok_s": gen, "prompt_tok_s": prompt,
                           "prompt_tokens": measured.get("prompt_tokens"),
                           "gen_tokens": measured.get("predicted_tokens"),
                           "band": None if band is None else band.model_dump(mode="json"), "passed": None,
                           "causes": [], "detail": measured.get("detail") or ""}
    if band is None or not gen:
        return row
    low = [f"generation {gen:.1f} tok/s is below the band's {band.gen_tok_s[0]:g}"] if gen < band.gen_tok_s[0] else []
    if band.prompt_tok_s is not None and prompt is not None and prompt < band.prompt_tok_s[0]:
        low.append(f"prompt processing {prompt:.1f} tok/s is below the band's {band.prompt_tok_s[0]:g}")
    row["passed"] = not low
    row["problems"] = low
    if low:
        row["causes"] = likely_causes(service, profile, burn_in, power)
    return row


def _throughput_check(row: Mapping[str, Any]) -> dict[str, Any]:
    band = row["band"]
    rates = f"generation {row['gen_tok_s']:.1f} tok/s, prompt {row['prompt_tok_s'] or 0:.1f} tok/s"
    where = f"band for {band['hardware']}: at least {band['gen_tok_s'][0]:g} tok/s (source: {band['source']})"
    if row["passed"]:
        return check(f"throughput {row['service']}", "throughput", True, f"{rates}; {where}")
    return check(f"throughput {row['service']}", "throughput", False,
                 f"{'; '.join(row['problems'])} ({where}); likely causes: {'; '.join(row['causes'])}")


def endpoint_check(service: Service, answers: Mapping[str, Any], box: Box, *, tool_calls: bool = True,
                   ) -> dict[str, Any]:
    """``tool_calls``: the catalog says the model's template makes tool calls, so the round trip must work."""
    checked = answers.get(service.name) or {}
    problems = list(check_service(service, checked, key_required=expects_key(box)).problems)
    tool = checked.get("tool_call") or {}
    if checked and tool_calls and not tool.get("ok"):
        problems.append(f"tool call round trip through /v1/messages: {tool.get('detail') or 'not answered'}")
    streams = checked.get("streams") or {}
    for protocol in ("openai", "anthropic"):
        stream = streams.get(protocol) or {}
        if checked and not stream.get("ok"):
            problems.append(f"streaming on the {protocol} API: {stream.get('detail') or 'not answered'}")
    if problems:
        return check(f"endpoint {service.name}", "endpoints", False, "; ".join(problems))
    tooled = (f"a tool call went out as {tool.get('tool_name')!r} and its result came back "
              f"({tool.get('final_stop_reason')})" if tool_calls else "no tool call (the catalog says the model's "
              "template makes none)")
    served = service.model if service.on_demand is None else ", ".join(service.models) + " on demand"
    loads = ""
    if service.on_demand is not None:  # each model's first turn, which loaded it when the router had another loaded
        turns = ", ".join(f"{model} {((checked.get('models') or {}).get(model) or {}).get('openai', {}).get('seconds', '?')} s"
                          for model in service.models)
        loads = f"; each model's first turn, its load included: {turns}"
    return check(f"endpoint {service.name}", "endpoints", True,
                 f"health ok; serves {served}; OpenAI and Anthropic APIs answered; {tooled}; both APIs "
                 f"streamed to the end; {'the key is required' if (checked.get('auth') or {}).get('required') else 'no key'}"
                 f"{loads}")


def parse_events(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The thermal guard's JSON lines; a line that is not one (a torn write) is skipped."""
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def parse_power(text: str) -> dict[str, Any] | None:
    try:
        power = json.loads(text) if text.strip() else None
    except ValueError:
        return None
    return power if isinstance(power, dict) else None


def _bus_key(bus_id: Any) -> str | None:
    """A PCI address however it is spelled: nvidia-smi's 8-digit domain or lspci's 4, either case."""
    parts = str(bus_id or "").strip().lower().split(":")
    if len(parts) not in (2, 3) or not all(parts):
        return None
    try:
        domain = int(parts[0], 16) if len(parts) == 3 else 0
    except ValueError:
        return None
    return f"{domain:x}:{parts[-2]}:{parts[-1]}"


def _whole(value: Any) -> int | None:
    """A count read from the box (MiB, a PID), or None where it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def gpu_memory(plan: ServePlan, profile: HardwareProfile, extras: Mapping[str, Any], *, windows: bool,
               ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, str]]]:
    """What each card holds for the plan's services once they serve (nvidia-smi's per-process used memory, each
    process the main PID of a service's unit, each card found by UUID or PCI address) against the plan's estimate
    for that card (the sum of its services' ``memory.per_device_mib["cuda<index>"]``).

    Returns the report's rows (None: not read), the checks (one per card the plan or its processes use; more held
    than planned fails) and what was not checked. Processes of no planned service are recorded, never counted."""
    if windows:
        return None, [], [{"name": GPU_MEMORY, "why": "read on Linux boxes only (llama_box_state)"}]
    if not profile.gpus:
        return None, [], [{"name": GPU_MEMORY, "why": "the box has no NVIDIA GPU: every service runs on the CPU"}]
    if "gpu_processes" not in extras:
        return None, [], [{"name": GPU_MEMORY, "why": "the certification play did not read what each process holds on "
                                                      "the GPUs"}]
    if extras.get("gpu_processes_error"):
        return None, [check(GPU_MEMORY, "gpu_memory", False, "nvidia-smi did not say what each process holds on the "
                            f"cards: {extras['gpu_processes_error']}")], []
    units = extras.get("units") or {}
    owner = {pid: service.name for service in plan.services
             if (pid := _whole((units.get(service.name) or {}).get("main_pid")))}
    # an on-demand router's model servers are its children: known by the unit whose control group holds them
    unit_owner = {f"{service.name}.service": service.name for service in plan.services}
    by_uuid = {gpu.uuid.lower(): gpu for gpu in profile.gpus if gpu.uuid}
    by_bus = {key: gpu for gpu in profile.gpus if (key := _bus_key(gpu.pci_bus_id))}
    held: dict[int, dict[str, int | None]] = {}
    pids: dict[int, dict[str, list[int]]] = {}
    others: dict[int, int] = {}
    strays: list[str] = []
    for process in extras.get("gpu_processes") or []:
        gpu = by_uuid.get(str(process.get("gpu_uuid") or "").lower()) or by_bus.get(_bus_key(process.get("gpu_bus_id")))
        service = owner.get(process.get("pid")) or unit_owner.get(str(process.get("unit") or ""))
        used = _whole(process.get("used_mib"))
        if service is None:
            if gpu is not None:
                others[gpu.index] = others.get(gpu.index, 0) + (used or 0)
        elif gpu is None:
            strays.append(f"{service} (PID {process.get('pid')}) holds {'?' if used is None else used} MiB on a card "
                          f"the probe did not see ({process.get('gpu_uuid') or process.get('gpu_bus_id') or 'unnamed'})")
        else:
            card = held.setdefault(gpu.index, {})
            before = card.get(service, 0)
            card[service] = None if used is None or before is None else before + used
            pids.setdefault(gpu.index, {}).setdefault(service, []).append(process["pid"])

    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    not_checked: list[dict[str, str]] = []
    for gpu in sorted(profile.gpus, key=lambda item: item.index):
        device = f"cuda{gpu.index}"
        planned = {service.name: service.memory.per_device_mib[device] for service in plan.services
                   if device in service.memory.per_device_mib}
        card = held.get(gpu.index, {})
        if not planned and not card and not others.get(gpu.index):
            continue
        names = list(dict.fromkeys([*planned, *card]))
        unknown = [name for name in card if card[name] is None]
        planned_mib = sum(planned.values())
        used_mib = None if unknown else sum(mib or 0 for mib in card.values())
        row: dict[str, Any] = {
            "gpu": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "memory_mib": gpu.memory_mib,
            "planned_mib": planned_mib, "used_mib": used_mib, "other_mib": others.get(gpu.index, 0),
            "services": [{"service": name, "planned_mib": planned.get(name, 0),
                          "used_mib": card.get(name, 0), "pids": pids.get(gpu.index, {}).get(name, [])}
                         for name in names],
            "passed": None}
        rows.append(row)
        if not names:
            continue  # only processes of no planned service: recorded, nothing to judge
        label = f"GPU {gpu.index} memory vs plan"
        card_name = f"GPU {gpu.index} ({gpu.name}{', ' + gpu.uuid if gpu.uuid else ''})"
        if used_mib is None:
            not_checked.append({"name": label, "why": f"nvidia-smi does not say how much {', '.join(unknown)} holds "
                                                      f"on {card_name}"})
            continue
        row["passed"] = used_mib <= planned_mib
        each = "; ".join(f"{name} holds {card.get(name, 0)} MiB of {planned.get(name, 0)} MiB planned" for name in names)
        idle = [name for name in planned if name not in card]
        if row["passed"]:
            detail = (f"{card_name} holds {used_mib} MiB for the plan's services, within the {planned_mib} MiB the "
                      f"plan estimates ({each})"
                      + (f"; {', '.join(idle)} holds nothing on it" if idle else ""))
        else:
            detail = (f"{card_name} holds {used_mib} MiB for the plan's services, {used_mib - planned_mib} MiB more "
                      f"than the {planned_mib} MiB the plan estimates ({each}): the estimate is too low for this box")
        if row["other_mib"]:
            detail += f"; other processes hold {row['other_mib']} MiB on it"
        checks.append(check(label, "gpu_memory", bool(row["passed"]), detail))
    if strays:
        checks.append(check(GPU_MEMORY, "gpu_memory", False, "; ".join(strays)))
    elif not any(row["services"] for row in rows):
        checks.append(check(GPU_MEMORY, "gpu_memory", True, f"the plan puts no service on the box's "
                            f"{len(profile.gpus)} GPU(s) and no service holds memory on them"))
    return rows, checks, not_checked


def evaluate(box: Box, plan: ServePlan, profile: HardwareProfile, catalog: Catalog, run: RunResult | None,
             verify: Mapping[str, Any], state: Mapping[str, Any] | None, extras: Mapping[str, Any], *,
             fleet_path: str, locked: Any, engine_root: str, burn_in_s: float, thermal: Mapping[str, Any] | None,
             power_planned: bool) -> dict[str, Any]:
    """Every check of the certification, and what they rest on: the report's ``checks``, ``not_checked`` and the
    sections that are measurements (``throughput``, ``burn_in``, ``thermal_guard``, ``power``, ``status``,
    ``gpu_memory``)."""
    checks: list[dict[str, Any]] = []
    not_checked: list[dict[str, str]] = []
    windows = bool(extras.get("windows")) or box.os == "windows"

    if run is None or run.status != "successful":
        failed = "; ".join(f"{task.task}: {task.message}" for task in (run.failed if run else [])[:3])
        checks.append(check("certification run", "run", False,
                            f"playbooks/certify.yml {run.status if run else 'did not run'}"
                            + (f": {failed}" if failed else "")))

    gpus = profile.gpus
    planned = sorted({index for service in plan.services for index in service.gpus})
    missing = [index for index in planned if index not in {gpu.index for gpu in gpus}]
    checks.append(check("identity", "identity", not missing and not profile.gpu_index_problem(),
                        (f"the plan serves on GPU {missing} which the probe did not see" if missing else
                         f"{len(gpus)} GPU(s): " + (", ".join(f"{g.index}: {g.name} {g.memory_mib} MiB" for g in gpus)
                                                    or "none (CPU serving)")
                         + f"; driver {profile.driver.version or 'none'}"
                         + (f" ({profile.driver.model})" if profile.driver.model else "")
                         + f"; {profile.cpu.model or 'CPU ?'}, {profile.memory_mib} MiB RAM")))
    if not gpus:
        not_checked.append({"name": "GPU identity (UUIDs, serials, NVLink)", "why": "the box has no NVIDIA GPU"})

    status = None
    if windows:
        not_checked.append({"name": "installed files and units", "why": "read on Linux boxes only (llama_box_state)"})
    else:
        status = box_status(box, plan, state, fleet_path=fleet_path, locked=locked, engine_root=engine_root)
        problems = [f"{drift.detail} (fix: {drift.fix})" for drift in status.drift]
        if status.error:
            problems.insert(0, status.error)
        checks.append(check("installed as planned", "installed", not problems,
                            "; ".join(problems) if problems else
                            f"units, {len(status.models)} model file(s) against their install records and "
                            f"{len(status.engines)} engine(s) are as planned"
                            + (" and as locked" if status.locked else "; no lock for this box")))

    for service in plan.services:
        tool_calls = catalog.model(service.model).tool_calls
        checks.append(endpoint_check(service, verify, box, tool_calls=tool_calls))
        if not tool_calls:
            not_checked.append({"name": f"tool call round trip {service.name}",
                                "why": f"the catalog says {service.model}'s chat template makes no tool calls "
                                       "(tool_calls: false)"})

    memory, memory_checks, memory_unchecked = gpu_memory(plan, profile, extras, windows=windows)
    checks += memory_checks
    not_checked += memory_unchecked

    burn_in = dict(extras.get("burn_in") or {}) or None
    power = parse_power(str(extras.get("power") or ""))
    throughput = [throughput_row(service, verify, profile, catalog, burn_in, power) for service in plan.services]
    cards = {service.name: len(service.gpus) for service in plan.services}
    for row in throughput:
        if row["band"] is None:
            not_checked.append({"name": f"throughput {row['service']}",
                                "why": f"the catalog has no throughput band for {row['model']} on this hardware "
                                       f"({cards[row['service']]} GPU(s)); measured "
                                       f"{row['gen_tok_s'] or 0:.1f} tok/s generation"})
        elif row["passed"] is None:
            checks.append(check(f"throughput {row['service']}", "throughput", False,
                                f"no rate measured: {row['detail'] or 'the server gave no timings'}"))
        else:
            checks.append(_throughput_check(row))

    if burn_in_s > 0:
        if burn_in is None:
            if windows:
                not_checked.append({"name": "burn-in", "why": "the burn-in runs on Linux boxes only"})
            else:
                boot = extras.get("boot_id") or {}
                rebooted = bool(boot.get("before") and boot.get("after") and boot["before"] != boot["after"])
                checks.append(check("burn-in", "burn_in", False, "the box rebooted during the burn-in (its boot id "
                                    "changed)" if rebooted else "the burn-in did not run to the end"
                                    + (f": {extras['burn_in_error']}" if extras.get("burn_in_error") else "")))
        else:
            requests = burn_in.get("requests") or {}
            ok = sum(int(item.get("ok") or 0) for item in requests.values())
            problems = list(burn_in.get("problems") or [])
            if not ok:
                problems.append("no request finished during the burn-in")
            checks.append(check("burn-in", "burn_in", not problems, "; ".join(problems) if problems else
                                f"{burn_in.get('duration_s', burn_in_s):g} s, {ok} requests, no errors, no throttling, "
                                "no service restart, same boot"))
            if not burn_in.get("gpu_sampled"):
                not_checked.append({"name": "GPU temperatures, power and throttling during the burn-in",
                                    "why": "nvidia-smi did not answer on the box (no NVIDIA GPU)"})
    else:
        not_checked.append({"name": "burn-in", "why": "not asked for (controller certify --burn-in 25m)"})

    units = extras.get("units") or {}
    guard_unit = units.get(GUARD_UNIT) or {}
    events = parse_events(extras.get("guard_events") or [])
    guard = {"installed": guard_unit.get("load") == "loaded", "active": guard_unit.get("active") == "active",
             **{key: value for key, value in (thermal or {}).items() if key != "guard"}, "events": events}
    if windows:
        not_checked.append({"name": "thermal guard", "why": "its events are read on Linux boxes only"})
    elif thermal is None:
        not_checked.append({"name": "thermal guard", "why": "not installed: the box serves no GPU (fleet thermal.guard"
                                                            " turns it on)"})
    else:
        stops = [event for event in events if event.get("kind") in ("stop", "limit")]
        problems = [] if guard["active"] else [f"{GUARD_UNIT} is {guard_unit.get('active') or 'not installed'}"]
        checks.append(check("thermal guard", "thermal", not problems,
                            "; ".join(problems) if problems else
                            f"running; warns at {guard.get('warn_c')} C, stops the servers at {guard.get('stop_c')} C; "
                            f"{len(events)} event(s), {len(stops)} stop(s)"))
    if power_planned and not windows:
        limits = (power or {}).get("limits") or []
        unapplied = [limit for limit in limits if not limit.get("applied")]
        checks.append(check("power limits", "power", bool(limits) and not unapplied,
                            "no record of the power limits being applied" if not limits else
                            "; ".join(f"GPU {limit.get('gpu')} at {limit.get('watts')} W"
                                      + ("" if limit.get("applied") else " NOT applied") for limit in limits)
                            + f"; persistence mode {'on' if (power or {}).get('persistence') else 'off'}"))
    elif not power_planned:
        not_checked.append({"name": "power limits", "why": "the fleet sets none (power_limit_w)"})

    return {"checks": checks, "not_checked": not_checked, "throughput": throughput, "burn_in": burn_in,
            "thermal_guard": guard if thermal is not None or events else None, "power": power,
            "status": None if status is None else status.to_json(), "gpu_memory": memory}
