"""nvidia-smi -q: each card's device minor number (/dev/nvidia<minor>) and UUID, matched to the cards by PCI bus id
(issue 20). The real driver-580 answer is in ../shared/fixtures/gpu-h100-580 (read when present)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controller.stages.probe import LINUX_PROBE_COMMANDS, PROBE_FILES, parse_outputs, read_dir
from tests.unit.probe.helpers import machine, warnings_about

Q = "nvidia-smi-q.txt"
RECORDED = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "gpu-h100-580"


def _section(bus: str, uuid: str | None = "GPU-aaaaaaaa-0000-0000-0000-000000000001", minor: str = "0") -> str:
    lines = [f"GPU {bus}", "    Product Name                                       : Tesla V100-PCIE-32GB"]
    if uuid:
        lines.append(f"    GPU UUID                                           : {uuid}")
    lines += [f"    Minor Number                                       : {minor}",
              "    Fabric", "        ClusterUUID                                    : N/A",
              "    PCI", f"        Bus Id                                         : {bus}"]
    return "\n".join(lines) + "\n"


def _q(*sections: str) -> str:
    return "==============NVSMI LOG==============\n\nDriver Version : 580.95.05\n\n" + "".join(sections)


def test_the_probe_runs_nvidia_smi_q_and_reads_its_output():
    assert Q in PROBE_FILES and " -q" in LINUX_PROBE_COMMANDS[Q]


def test_the_real_driver_580_answer_gives_the_card_its_minor_number():
    if not RECORDED.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{RECORDED} is missing; CI runs with shared/ beside the clone")
        pytest.skip("../shared/fixtures/gpu-h100-580 is not beside this clone")
    outputs = read_dir(RECORDED / "probe") | {Q: (RECORDED / "nvidia-smi" / "smi-q.txt").read_text()}
    profile = parse_outputs(outputs)
    (gpu,) = profile.gpus
    assert gpu.minor_number == 0 and gpu.uuid == "GPU-0fa0c0de-1111-2222-3333-444455556666"
    assert profile.warnings == []


def test_twelve_cards_whose_nodes_the_driver_numbered_otherwise_than_nvidia_smi():
    profile = parse_outputs(machine("twelve-v100-threadripper"))
    assert [(gpu.index, gpu.minor_number) for gpu in profile.gpus] == [
        (0, 2), (1, 3), (2, 0), (3, 1), (4, 6), (5, 7), (6, 4), (7, 5), (8, 10), (9, 11), (10, 8), (11, 9)]
    assert profile.warnings == []


def test_windows_prints_no_minor_number():
    profile = parse_outputs(machine("dual-v100-nvlink-windows-tcc"))
    assert [gpu.minor_number for gpu in profile.gpus] == [None, None]
    assert profile.warnings == []


def test_a_profile_probed_without_it_has_no_minor_numbers_and_no_probe_warning():
    profile = parse_outputs(machine("epyc-4x3090-2xv100-pcie"))
    assert profile.gpus and all(gpu.minor_number is None for gpu in profile.gpus)
    assert warnings_about(profile, Q) == []


def test_the_uuid_comes_from_it_when_only_the_table_was_read():
    outputs = machine("single-v100-32g-table-only")
    profile = parse_outputs(outputs)
    (gpu,) = profile.gpus
    assert gpu.uuid is None and gpu.pci_bus_id
    profile = parse_outputs(outputs | {Q: _q(_section(gpu.pci_bus_id, minor="5"))})
    (gpu,) = profile.gpus
    assert gpu.minor_number == 5 and gpu.uuid == "GPU-aaaaaaaa-0000-0000-0000-000000000001"


def test_sections_that_do_not_match_the_cards_are_named():
    csv = ("index, uuid, name, pci.bus_id\n"
           "0, GPU-aaaaaaaa-0000-0000-0000-000000000001, Tesla V100-PCIE-32GB, 00000000:04:00.0\n"
           "1, GPU-aaaaaaaa-0000-0000-0000-000000000002, Tesla V100-PCIE-32GB, 00000000:1B:00.0\n")
    text = _q(_section("00000000:04:00.0"), _section("00000000:88:00.0", uuid="GPU-bbbbbbbb-0000-0000-0000-0", minor="7"))
    profile = parse_outputs({"nvidia-smi-query.csv": csv, Q: text})
    assert [gpu.minor_number for gpu in profile.gpus] == [0, None]
    found = warnings_about(profile, Q)
    assert any("has no section for GPU 1" in warning and "minor number is unknown" in warning for warning in found)
    assert any("the GPU at 00000000:88:00.0 is not among the GPUs nvidia-smi lists" in warning for warning in found)


def test_two_cards_claiming_one_node_keep_neither():
    csv = ("index, name, pci.bus_id\n0, Tesla V100-PCIE-32GB, 00000000:04:00.0\n"
           "1, Tesla V100-PCIE-32GB, 00000000:1B:00.0\n")
    text = _q(_section("00000000:04:00.0", uuid=None, minor="3"), _section("0000:1B:00.0", uuid=None, minor="3"))
    profile = parse_outputs({"nvidia-smi-query.csv": csv, Q: text})
    assert [gpu.minor_number for gpu in profile.gpus] == [None, None]
    assert any("GPUs 0, 1 all give minor number 3" in warning for warning in warnings_about(profile, Q))


@pytest.mark.parametrize("value", ["two", "255", "-1"])
def test_a_minor_number_that_is_no_cards_is_refused(value):
    csv = "index, name, pci.bus_id\n0, Tesla V100-PCIE-32GB, 00000000:04:00.0\n"
    profile = parse_outputs({"nvidia-smi-query.csv": csv, Q: _q(_section("00000000:04:00.0", minor=value))})
    assert profile.gpus[0].minor_number is None
    assert any(f"Minor Number '{value}'" in warning for warning in warnings_about(profile, Q))


def test_output_without_a_gpu_section_is_named_once():
    profile = parse_outputs({"nvidia-smi-query.csv": "index, name\n0, Tesla V100-PCIE-32GB\n", Q: "something else\n"})
    assert warnings_about(profile, Q) == [f"{Q}: no GPU section found in it (expected lines 'GPU 00000000:04:00.0' of "
                                          "nvidia-smi -q)"]
