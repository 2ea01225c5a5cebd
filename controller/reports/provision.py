"""The provisioning report handed to whoever gets the box: what was found, planned and verified.

This module formats (JSON, Markdown); whether the box is verified is controller.stages.verify's verdict.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from controller.inventory import Inventory
from controller.model.fleet import Box
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan
from controller.stages.runner import RunResult
from controller.stages.verify import expects_key, report_fields, verdict

# Seed figures, one V100, same build and flags, TCC vs MCDM: decode tokens per second.
MCDM_NOTE = ("the V100s run in MCDM mode so WSL2 can see them; decode is slower than native TCC (measured on one "
             "card: Gemma 4 99.8 -> 56.8 tok/s, Qwen3 54.5 -> 37.7 tok/s); serve from native Windows to get TCC")


def driver_section(box: Box, run: RunResult | None) -> dict[str, Any]:
    """What the driver role did on the box, and what the buyer should know about it."""
    data = {} if run is None else (run.data.get("nvidia_driver") or {})
    section = dict(data.get(box.name) or {})
    notes = list(section.get("notes") or [])
    if box.os == "windows" and box.driver.wsl2:
        notes.append(MCDM_NOTE)
    if (section.get("reboot_required") or section.get("reboot_needed")) and not section.get("rebooted"):
        notes.append("a reboot is needed before the new driver or mode is in use; reboot the box (or set "
                     "driver.allow_reboot: true in the fleet file) and provision again")
    section["notes"] = notes
    return section


def cache_section(box: Box, run: RunResult | None) -> dict[str, Any] | None:
    """Where the box's model files and engine packs came from when the fleet has a LAN cache (None: no cache).

    The download roles publish, per kind, whether the cache answered and whether they fell back to upstream.
    """
    cache = box.mirror.cache
    if cache is None:
        return None
    seen = ((run.data.get("lan_cache") or {}).get(box.name) or {}) if run is not None else {}
    notes = []
    for kind in ("models", "engines"):
        item = seen.get(kind) or {}
        if item and not item.get("answered"):
            notes.append(f"the LAN cache on {cache.host} ({cache.url}) did not answer: {kind} "
                         + ("came from upstream (the fleet allows it: cache.fallback: true)" if item.get("fallback")
                            else "still to download stopped provisioning (cache.fallback: false)"))
    return {"host": cache.host, "url": cache.url, "fallback_allowed": cache.fallback,
            **{kind: seen[kind] for kind in ("models", "engines") if kind in seen}, "notes": notes}


def fast_path_section(box: Box, run: RunResult | None) -> dict[str, Any] | None:
    """What site.yml's first comparison decided for the box: converged (only the servers were checked) or a full
    run, with the differences it found (None: no comparison, a Windows box or no run)."""
    seen = ((run.data.get("fast_path") or {}).get(box.name)) if run is not None else None
    if not seen:
        return None
    return {"converged": bool(seen.get("converged")), "reasons": list(seen.get("reasons") or [])}


def _on_demand_lines(service: dict[str, Any]) -> list[str]:
    """An on-demand router's models: each one's first turn, which loaded it when it was not loaded."""
    if not service.get("on_demand"):
        return []
    answers = service.get("models") or {}
    lines = [f"- On demand: {', '.join(service['on_demand']['models'])}, at most "
             f"{service['on_demand']['max_loaded']} loaded at once"]
    for model in service["on_demand"]["models"]:
        openai = (answers.get(model) or {}).get("openai") or {}
        lines.append(f"  - {model}: " + (f"first turn (its load included when it was not loaded) "
                                         f"{openai['seconds']} s" if "seconds" in openai else "not checked"))
    return lines


def build_report(box: Box, profile: HardwareProfile, plan: ServePlan, run: RunResult | None,
                 verify: dict[str, Any], probe_seconds: float) -> dict[str, Any]:
    """The report of one box; ``verify`` is what its checks answered (controller.stages.verify.results)."""
    outcome = verdict(plan, verify, run, key_required=expects_key(box))
    services = [{
        "name": service.name,
        "model": service.model,
        "engine": service.engine,
        "endpoint": f"http://{service.host}:{service.port}",
        "gpus": service.gpus,
        "ctx": service.ctx,
        "parallel": service.parallel,
        **report_fields(verify, outcome, service.name),
        "reasons": service.reasons,
        **({"on_demand": {"models": service.models, "max_loaded": service.on_demand.max_loaded}}
           if service.on_demand is not None else {}),
    } for service in plan.services]
    return {
        "box": box.name,
        "address": box.address,
        "generated": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "hardware": {
            "gpus": [f"{gpu.index}: {gpu.name} {gpu.memory_mib} MiB" for gpu in profile.gpus],
            "driver": profile.driver.version,
            "cpu": profile.cpu.model,
            "cores": profile.cpu.cores,
            "memory_mib": profile.memory_mib,
            "os": f"{profile.os.name or ''} {profile.os.version or ''}".strip(),
            "warnings": profile.warnings,
            "probe_seconds": round(probe_seconds, 2),
        },
        "run": None if run is None else {
            "playbook": run.playbook,
            "status": run.status,
            "elapsed": round(run.elapsed, 1),
            "changed": run.changed,
            "stats": {host: vars(stats) for host, stats in run.stats.items()},
            # Where a run stopped early (Ctrl-C): the last task started; null for a finished run.
            "stopped_at": run.last_task if run.status == "interrupted" else None,
            "strategy": run.strategy,  # the Ansible strategy it ran under (controller/stages/strategy.py)
        },
        "driver": driver_section(box, run),
        "cache": cache_section(box, run),
        "fast_path": fast_path_section(box, run),
        "services": services,
        "unplaced": [item.model_dump() for item in plan.unplaced],
        "verified": outcome.verified,
        # Every wanted model (and draft) placed: a box that serves only what fits is not the box that was asked for.
        "provisioned_as_asked": not plan.unplaced,
    }


def not_as_asked(report: dict[str, Any]) -> str | None:
    """Why the box is not what its fleet entry asked for (each wanted model the plan could not place, and why), or
    None when it is; ``verified`` says only that what was placed answered."""
    if report.get("provisioned_as_asked", True) and not report.get("unplaced"):
        return None
    return "; ".join(f"{item['model']} was not placed: {item['reason']}" for item in report.get("unplaced") or []) \
        or "a wanted model was not placed"


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    lines = [
        f"# Box {report['box']} ({report['address']})",
        "",
        f"Generated {report['generated']}. " + _verdict_line(report),
        "",
        "## Hardware",
        f"- GPUs: {', '.join(hw['gpus']) or 'none'}",
        f"- Driver: {hw['driver'] or 'none'}",
        f"- CPU: {hw['cpu']} ({hw['cores']} cores), RAM {hw['memory_mib']} MiB, {hw['os']}",
        *[f"- Warning: {warning}" for warning in hw["warnings"]],
    ]
    driver = report.get("driver") or {}
    if driver.get("status") or driver.get("notes"):
        lines += ["", "## Driver"]
        if driver.get("status"):
            lines.append(f"- {driver['status']}: version {driver.get('version') or 'none'}"
                         + (f", {driver['message']}" if driver.get("message") else ""))
        lines += [f"- Note: {note}" for note in driver.get("notes", [])]
    cache = report.get("cache") or {}
    if cache:
        lines += ["", "## LAN cache", f"- Files through the cache on {cache['host']} ({cache['url']}); upstream "
                  f"fallback {'allowed' if cache['fallback_allowed'] else 'not allowed'}"]
        lines += [f"- Note: {note}" for note in cache.get("notes", [])]
    fast = report.get("fast_path")
    if fast:
        lines += ["", "## This run", "- The box matched the record of its last full run: only the servers were checked"
                  if fast["converged"] else "- A full run: " + ("; ".join(fast["reasons"]) or "every role ran")]
    lines += ["", "## Services"]
    for service in report["services"]:
        openai, anthropic = service.get("openai") or {}, service.get("anthropic") or {}
        lines += [
            f"### {service['model']} at {service['endpoint']}",
            f"- Verified: {'yes' if service['verified'] else 'NO'}; health {service['health']}; "
            f"serves {', '.join(service['served_ids']) or 'nothing'}",
            f"- OpenAI API: {openai.get('completion_tokens', 0)} tokens at {openai.get('tokens_per_second', 0)} tok/s",
            f"- Anthropic API: {anthropic.get('output_tokens', 0)} tokens, stop reason {anthropic.get('stop_reason')}",
            _auth_line(service.get("auth") or {}, service["name"]),
            *_on_demand_lines(service),
            f"- Engine {service['engine']}, GPUs {service['gpus'] or 'none (CPU)'}, context {service['ctx']}, "
            f"{service['parallel']} slot(s)",
            *[f"  - {reason}" for reason in service["reasons"]],
        ]
    if report["run"]:
        run = report["run"]
        lines += ["", "## Run", f"- {run['playbook']}: {run['status']} in {run['elapsed']} s, {run['changed']} changed"
                  + (f", under Ansible's {run['strategy']} strategy" if run.get("strategy") else "")]
        if run["status"] == "interrupted":
            lines.append(f"- Stopped during task: {run.get('stopped_at') or 'none started yet'}; provision again to "
                         "finish (the run converges)")
    if report["unplaced"]:  # last, where the eye lands when the command ends
        lines += ["", "## Not provisioned as asked",
                  "The box serves the models above; these wanted models are not served:"]
        lines += [f"- Not placed: {item['model']}: {item['reason']}" for item in report["unplaced"]]
    return "\n".join(lines) + "\n"


def _verdict_line(report: dict[str, Any]) -> str:
    verified = "yes" if report["verified"] else "NO"
    if not_as_asked(report) is None:
        return f"Verified: **{verified}**."
    count = len(report.get("unplaced") or [])
    return (f"Provisioned as asked: **NO** ({count} wanted model{'s' if count != 1 else ''} not placed, listed at the "
            f"end); the {len(report['services'])} service(s) placed verified: **{verified}**.")


def _auth_line(auth: dict[str, Any], name: str) -> str:
    if not auth.get("required"):
        return "- API key: none (loopback only)" if auth else "- API key: not checked"
    return (f"- API key: required; without it HTTP {auth.get('anonymous_status')}, with a wrong one HTTP "
            f"{auth.get('wrong_key_status')}; clients read it from /etc/llama/keys/{name}.key on the box")


def write_report(inventory: Inventory, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write the box's provisioning report into the inventory, as JSON and Markdown; returns both paths."""
    return inventory.write_report(report, markdown(report))
