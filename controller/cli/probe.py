"""``controller probe``: show what a box has, from a live probe or from captured outputs.

Both ways end in the same profile and the same output code, so what an operator sees for a live box
is exactly what they see for the files they captured from it:

    controller probe box3 --fleet fleet.yml --json
    controller probe --from-dir captures/box3/
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from controller.errors import FleetError, ProbeError
from controller.model.profile import HardwareProfile
from controller.stages.probe.groups import group_names
from controller.stages.probe.parse import PROBE_FILES, parse_outputs, read_dir


def _from_dir(folder: Path, model_dir: str | None) -> HardwareProfile:
    outputs = read_dir(folder)
    if not outputs:
        raise ProbeError(f"{folder}: none of the probe files is there (expected some of: {', '.join(PROBE_FILES)})")
    return parse_outputs(outputs, model_dir=model_dir)


def _from_box(name: str, fleet_path: Path | None) -> HardwareProfile:
    if fleet_path is None:
        raise FleetError(f"probing box {name!r} needs the fleet file that says how to reach it: add --fleet FILE")
    from controller.inventory import Inventory
    from controller.model.fleet import load_fleet
    from controller.stages.probe.collect import probe_box  # the transports pull in fabric and pywinrm

    known_hosts = Inventory.beside(fleet_path).known_hosts_file  # the default inventory's: probe takes no --inventory
    profile, _raw, _seconds = probe_box(load_fleet(fleet_path).box(name), known_hosts=known_hosts)
    return profile


def _nothing_usable_reason(source: str, profile: HardwareProfile) -> str:
    first = f"; first problem: {profile.warnings[0]}" if profile.warnings else ""
    return f"nothing usable was parsed from {source}: no GPU, NVLink, driver, CPU, memory or OS facts{first}"


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f} GiB"


def _summary(profile: HardwareProfile, console: Console) -> None:
    """A short human view: the GPUs, how they are joined, and the facts the planner uses."""
    if profile.gpus:
        table = Table(title="GPUs", title_justify="left")
        for column in ("#", "name", "memory", "cc", "bus id"):
            table.add_column(column)
        for gpu in profile.gpus:
            table.add_row(str(gpu.index), gpu.name, _gib(gpu.memory_mib), gpu.compute_capability or "?",
                          gpu.pci_bus_id or "?")
        console.print(table)
    else:
        console.print("GPUs: none visible")
    driver = profile.driver
    if driver.version:
        mode = f", {driver.model}" if driver.model else ""
        console.print(f"driver: {driver.version} (CUDA {driver.cuda_version or '?'}{mode})")
    links = ", ".join(f"{i}-{j} NV{n}" for i, j, n in profile.nvlink.pairs) or "none"
    console.print(f"NVLink: {links}")
    boards = " ".join(f"{number}:{{{','.join(map(str, board))}}}" for number, board in enumerate(profile.boards))
    console.print(f"boards: {boards + ' (a fleet pins a model to one with board: N)' if boards else 'none'}")
    cpu = profile.cpu
    features = ", ".join(name for name, present in (("AVX2", cpu.avx2), ("AVX-512", cpu.avx512)) if present)
    console.print(f"CPU: {cpu.model or '?'} ({cpu.cores or '?'} cores, {cpu.threads or '?'} threads"
                  f"{', ' + features if features else ''})")
    console.print(f"memory: {_gib(profile.memory_mib)}")
    os_name = " ".join(part for part in (profile.os.name, profile.os.version) if part) or "?"
    console.print(f"OS: {profile.os.family or '?'} ({os_name}){' under WSL' if profile.os.wsl else ''}")
    for disk in profile.disks:
        console.print(f"disk: {disk.path}: {_gib(disk.free_mib)} free of {_gib(disk.total_mib)}")
    console.print(f"groups: {', '.join(group_names(profile))}")
    for warning in profile.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, markup=True)


def emit(profile: HardwareProfile, as_json: bool) -> None:
    """Print a profile as the contract JSON or as the human summary."""
    if as_json:
        click.echo(json.dumps(profile.model_dump(mode="json"), indent=2))
    else:
        _summary(profile, Console(highlight=False, soft_wrap=True, markup=False))  # probed text is never markup


@click.command("probe")
@click.argument("box", required=False)
@click.option("--fleet", "fleet_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Fleet file that says how to reach BOX.")
@click.option("--from-dir", "from_dir", type=click.Path(path_type=Path),
              help="Parse captured outputs (nvidia-smi.txt, cpuinfo, ...) from this folder instead of probing.")
@click.option("--model-dir", default=None, help="Where models will live; df.txt describes its filesystem.")
@click.option("--json", "as_json", is_flag=True, help="Print the hardware profile as JSON.")
def probe(box: str | None, fleet_path: Path | None, from_dir: Path | None, model_dir: str | None,
          as_json: bool) -> None:
    """Show the hardware of BOX (probed read-only over SSH or WinRM), or of captured outputs."""
    if (box is None) == (from_dir is None):
        raise click.UsageError("give either BOX (with --fleet FILE) or --from-dir DIR, not both or neither")
    profile = _from_box(box, fleet_path) if box is not None else _from_dir(from_dir, model_dir)
    if not profile.usable:
        raise ProbeError(_nothing_usable_reason(box or str(from_dir), profile))
    emit(profile, as_json)
