"""Profiles of the seeds' machines (the probe fixtures) and small helpers for the planner tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from controller.model.catalog import Catalog, load_catalog
from controller.model.fleet import WantedModel
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan, Service
from controller.stages.planner import plan_models
from controller.stages.probe.parse import parse_outputs, read_dir

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "probe"
SINGLE = "single-v100-16g-linux"  # one V100-SXM2-16GB, 6 cores, 31 GiB RAM
DUAL = "dual-v100-nvlink-windows-tcc"  # two V100 16 GB on a 2-link NVLink bridge, 12 cores
TWELVE = "twelve-v100-threadripper"  # boards {0,1} {2,3} {4,5,8,9} {6,7,10,11}, GPU 3 is 16 GB
CPU_ONLY = "cpu-only-no-driver"


@cache
def profile(machine: str) -> HardwareProfile:
    return parse_outputs(read_dir(FIXTURES / machine))


@cache
def catalog() -> Catalog:
    return load_catalog()


def plan(machine: str | HardwareProfile, *models: str | WantedModel, ctx: int | None = None, agents: int = 1,
         cat: Catalog | None = None) -> ServePlan:
    hardware = profile(machine) if isinstance(machine, str) else machine
    wanted = [model if isinstance(model, WantedModel) else WantedModel(id=model, ctx=ctx, agents=agents)
              for model in models]
    return plan_models(wanted, hardware, cat or catalog())


def only(result: ServePlan) -> Service:
    assert result.fits and len(result.services) == 1, result.unplaced
    return result.services[0]


def flag(service: Service, name: str) -> str | None:
    """The value after ``name`` in the service's arguments, or None when the flag is absent."""
    if name not in service.args:
        return None
    index = service.args.index(name)
    return service.args[index + 1] if index + 1 < len(service.args) else ""


def said(service: Service, *words: str) -> bool:
    """Whether one of the service's reasons mentions every word."""
    return any(all(word in reason for word in words) for reason in service.reasons)
