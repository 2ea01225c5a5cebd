"""``controller status``: what each box runs against its plan and the fleet's lock, with drift. Read-only."""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.cli.options import fleet_option, inventory_for, inventory_option, json_option, load


@click.command()
@click.argument("boxes", nargs=-1, metavar="[BOX|GROUP]...")
@click.option("--all", "everything", is_flag=True, help="Every box of the fleet.")
@fleet_option
@inventory_option
@json_option
def status(boxes: tuple[str, ...], everything: bool, fleet_path: Path, inventory: Path | None, as_json: bool) -> None:
    """Read the named boxes (or --all) at once and print their services, engines, models, GPUs and drift.

    Never changes a box (playbooks/status.yml runs in check mode). Exit 0 when every box answers, every
    planned server is running and healthy and nothing drifted; 3 a box did not answer (or was never
    provisioned), 6 a server is stopped or unhealthy, 9 drift only. A box this inventory sealed is named as
    handed over, not read, and changes no exit code.
    """
    from controller.actions.status import fleet_status
    from controller.stages.verify.status import exit_code, to_json

    fleet = load(fleet_path)
    names = fleet.select(boxes, everything)
    found = fleet_status(fleet, fleet_path, names, inventory_for(fleet_path, inventory))
    if as_json:
        click.echo(json.dumps(to_json(found)))
    else:
        for box in found:
            click.echo(human(box))
    click.get_current_context().exit(exit_code(found))


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def human(box) -> str:  # type: ignore[no-untyped-def]
    """One box: a headline, a table of its services, its engines, models and GPUs, then one line per drift."""
    if box.sealed:
        return f"{box.name}: {box.error}"
    if not box.reachable:
        return f"{box.name}: unreachable: {box.error}" + "".join(
            f"\n  drift {d.what}: {d.detail}\n    fix: {d.fix}" for d in box.drift)
    state = "healthy" if box.healthy else "NOT healthy"
    lines = [f"{box.name}: {state}, {len(box.drift) or 'no'} drift" + (f" ({box.error})" if box.error else "")]
    rows = [["service", "model", "port", "state", "enabled", "engine", "healthy", "serves"]]
    rows += [[s.name, s.model, str(s.port), s.state, s.enabled, s.engine, "yes" if s.healthy else "NO",
              s.served_model or "-"] for s in box.services]
    lines += _table(rows)
    for s in box.services:
        if s.error:
            lines.append(f"  {s.name}: {s.error}")
        if s.loaded is not None:
            lines.append(f"  {s.name}: on demand {', '.join(s.models)}; loaded now: {', '.join(s.loaded) or 'none'}")
    for engine in box.engines:
        locked = f", lock {engine['locked']}" if engine.get("locked") else ""
        lines.append(f"  engine {engine['slot']}: runs {engine['running'] or '-'} (plan {engine['planned']}{locked})")
    for model in box.models:
        how = "matches its install record" if model["ok"] else "see drift"
        lines.append(f"  model {model['file']}: {model['size_bytes']} bytes, {how}")
    for gpu in box.gpus:
        planned = f" (planned {gpu['memory_planned_mib']})" if gpu.get("memory_planned_mib") is not None else ""
        lines.append(f"  GPU {gpu.get('index')} {gpu.get('name')}: driver {gpu.get('driver_version')}, "
                     f"{_or(gpu.get('temperature_c'))} C, {_or(gpu.get('memory_used_mib'))}/{_or(gpu.get('memory_total_mib'))} "
                     f"MiB used{planned}")
    if box.gpu_error:
        lines.append(f"  GPUs: {box.gpu_error}")
    for drift in box.drift:
        lines.append(f"  drift {drift.what}: {drift.detail}\n    fix: {drift.fix}")
    return "\n".join(lines)


def _or(value: object) -> str:
    return "?" if value is None else str(value)
