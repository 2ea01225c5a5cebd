"""One small box for render tests: a CPU-only profile, a catalog with one tiny model, host_vars for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from controller.model.catalog import Catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import Cpu, HardwareProfile, OsInfo
from controller.stages.planner import plan_box
from controller.stages.render import host_vars

CPU_PROFILE = HardwareProfile(cpu=Cpu(model="EPYC", cores=2, threads=4), memory_mib=8192, os=OsInfo(family="linux"))


def tiny_catalog_file(folder: Path, sha256: str) -> Path:
    """A catalog file with the model ``tiny`` (1000 bytes, upstream engine, the given sha256)."""
    path = folder / "catalog.yml"
    path.write_text(yaml.safe_dump({"models": {"tiny": {"name": "t", "repo": "lab/r", "file": "t.gguf",
                                                        "size_bytes": 1000, "sha256": sha256, "engine": "upstream"}}}))
    return path


def tiny_box_vars(folder: Path, catalog: Catalog, **box: Any) -> dict[str, Any]:
    """host_vars of box ``box1`` (address 127.0.0.1 plus ``box``), planned on CPU_PROFILE."""
    fleet = parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", **box}}}, folder / "fleet.yml")
    target = fleet.box("box1")
    return host_vars(target, CPU_PROFILE, plan_box(target, CPU_PROFILE, catalog))
