"""Inventory groups for every fixture machine: one OS group (when known) and one GPU-shape group."""

from __future__ import annotations

import pytest

from controller.model.profile import Gpu, HardwareProfile, OsInfo
from controller.stages.probe import group_names, parse_outputs
from tests.unit.probe.helpers import machine, real_text


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("single-v100-16g-linux", ["linux", "single_v100_16g"]),
        ("single-v100-32g-table-only", ["linux", "single_v100_32g"]),
        ("dual-v100-nvlink-windows-tcc", ["windows", "dual_nvlink"]),
        ("wsl2-v100-16g", ["wsl", "single_v100_16g"]),
        ("twelve-v100-threadripper", ["linux", "multi_board"]),
        ("epyc-4x3090-2xv100-pcie", ["linux", "mixed"]),
        ("cpu-only-no-driver", ["linux", "cpu_only"]),
        ("cut-short-table", ["multi_board"]),  # no OS files captured: no OS group
    ],
)
def test_written_machines(name: str, groups: list[str]) -> None:
    assert group_names(parse_outputs(machine(name))) == groups


def test_dual_v100_beside_a_3090_is_mixed(real_fixtures) -> None:
    outputs = machine("dual-v100-sxm2-plus-3090-linux")
    outputs["nvidia-smi.txt"] = real_text(real_fixtures, "smi-2xv100-sxm2-plus-3090-linux-580.txt")
    outputs["nvidia-smi-topo.txt"] = real_text(real_fixtures, "topo-2xv100-sxm2-nv6-plus-3090-ansi-escapes.txt")
    outputs["os-release"] = 'NAME="Ubuntu"\nVERSION_ID="24.04"\n'
    assert group_names(parse_outputs(outputs)) == ["linux", "mixed"]


@pytest.mark.parametrize(
    ("machine_name", "topo_file"),
    [
        ("dgx1-8xv100", "topo-8xv100-dgx1-hybrid-cube-mesh-4mlx5-tabs-trailing-tab.txt"),
        ("aws-p3-8xlarge", "topo-4xv100-aws-p3.8xlarge-nv1-nv2-tabs-double-tab-na.txt"),
    ],
)
def test_one_big_board_is_multi_board(real_fixtures, machine_name: str, topo_file: str) -> None:
    outputs = machine(machine_name)
    outputs["nvidia-smi-topo.txt"] = real_text(real_fixtures, topo_file)
    assert group_names(parse_outputs(outputs)) == ["multi_board"]


def test_pcie_only_dual_v100_is_multi_board_not_dual_nvlink(real_fixtures) -> None:
    profile = parse_outputs({"nvidia-smi.txt": real_text(real_fixtures, "smi-2xv100-pcie-32gb-linux-535-no-processes.txt")})
    assert profile.boards == [[0], [1]]
    assert group_names(profile) == ["multi_board"]


def test_v100_size_from_the_name_when_memory_is_unknown() -> None:
    def single(name: str) -> HardwareProfile:
        return HardwareProfile(gpus=[Gpu(index=0, name=name)], boards=[[0]], os=OsInfo(family="linux"))

    assert group_names(single("Tesla V100-PCIE-32GB")) == ["linux", "single_v100_32g"]
    assert group_names(single("Tesla V100-SXM2...")) == ["linux", "single_v100_16g"]  # the smaller card assumed
