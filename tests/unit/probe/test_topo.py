"""topo -m matrices as people paste them, nvlink -s link counts, and boards as connected NVLink groups."""

from __future__ import annotations

import pytest

from controller.stages.probe import parse_outputs
from controller.stages.probe.topo import boards
from tests.unit.probe.helpers import machine, real_text, warnings_about

TOPO = "nvidia-smi-topo.txt"
NVLINK = "nvidia-smi-nvlink.txt"

DGX1_PAIRS = [(0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 3, 1), (1, 5, 2), (2, 3, 2), (2, 6, 1),
              (3, 7, 1), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2), (5, 7, 1), (6, 7, 2)]


@pytest.mark.parametrize(
    ("file", "pairs", "expected_boards"),
    [
        ("topo-2xv100-sxm2-nv6-plus-3090-ansi-escapes.txt", [(1, 2, 6)], [[0], [1, 2]]),
        ("topo-2x1080ti-phb-consumer-spaces.txt", [], [[0], [1]]),
        ("topo-4xa10-sys-2nics-gpu-numa-id-spaces.txt", [], [[0], [1], [2], [3]]),
        ("topo-4xv100-aws-p3.8xlarge-nv1-nv2-tabs-double-tab-na.txt",
         [(0, 1, 1), (0, 2, 1), (0, 3, 2), (1, 2, 2), (1, 3, 1), (2, 3, 2)], [[0, 1, 2, 3]]),
        ("topo-8xv100-dgx1-hybrid-cube-mesh-4mlx5-tabs-trailing-tab.txt", DGX1_PAIRS, [list(range(8))]),
        ("topo-8xv100-sxm2-aliyun-hybrid-cube-mesh-tabs-legend.txt",
         [(0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 6, 2), (1, 2, 2), (1, 3, 1), (1, 7, 2), (2, 3, 2), (2, 4, 1),
          (3, 5, 1), (4, 5, 2), (4, 6, 1), (4, 7, 2), (5, 6, 2), (5, 7, 1), (6, 7, 1)], [list(range(8))]),
        ("topo-8xv100-sxm2-azure-nd40rsv2-node-numa-tabs-legend.txt",
         [(0, 1, 2), (0, 2, 1), (0, 3, 2), (0, 6, 1), (1, 2, 2), (1, 3, 1), (1, 7, 1), (2, 3, 1), (2, 4, 2),
          (3, 5, 2), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2), (5, 7, 1), (6, 7, 2)], [list(range(8))]),
        ("topo-dgx1-8gpu-mp-pcie-only-4mlx5-tabs-no-nv-legend.txt", [], [[i] for i in range(8)]),
    ],
)
def test_real_matrices(real_fixtures, file: str, pairs: list[tuple[int, int, int]],
                       expected_boards: list[list[int]]) -> None:
    profile = parse_outputs({TOPO: real_text(real_fixtures, file)})
    assert profile.nvlink.pairs == pairs
    assert profile.boards == expected_boards
    assert profile.warnings == []


def test_real_a100_matrix_with_17_nics_keeps_nv12(real_fixtures) -> None:
    profile = parse_outputs({TOPO: real_text(real_fixtures, "topo-8xa100-nv12-17nics-nic-legend-spaces.txt")})
    assert len(profile.nvlink.pairs) == 28
    assert {links for _, _, links in profile.nvlink.pairs} == {12}
    assert profile.boards == [list(range(8))]
    assert profile.warnings == []


def test_crlf_and_spaces_instead_of_tabs_read_the_same(real_fixtures) -> None:
    text = real_text(real_fixtures, "topo-8xv100-dgx1-hybrid-cube-mesh-4mlx5-tabs-trailing-tab.txt")
    spaced = text.replace("\t", "    ").replace("\n", "\r\n")
    profile = parse_outputs({TOPO: spaced})
    assert profile.nvlink.pairs == DGX1_PAIRS
    assert profile.warnings == []


OLD_SOC_NO_LEGEND = ("\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\n"
                     "GPU0\t X \tNV2\tSOC\tSOC\t0-9,20-29\n"
                     "GPU1\tNV2\t X \tSOC\tSOC\t0-9,20-29\n"
                     "GPU2\tSOC\tSOC\t X \tPHB\t10-19,30-39\n"
                     "GPU3\tSOC\tSOC\tPHB\t X \t10-19,30-39\n")
NIC_COLUMNS = ("        mlx5_1  GPU1    NIC0    GPU0    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
               "mlx5_1   X      PIX     SYS     SYS\n"
               "GPU1    PIX      X      SYS     NV4     0-31    0               N/A\n"
               "NIC0    SYS     SYS      X      PIX\n"
               "GPU0    SYS     NV4     PIX      X      0-31    0               N/A\n")


@pytest.mark.parametrize("text, pairs, boards", [
    (OLD_SOC_NO_LEGEND, [(0, 1, 2)], [[0, 1], [2], [3]]),  # the old SOC code, and no legend
    (NIC_COLUMNS, [(0, 1, 4)], [[0, 1]]),  # NIC columns before and between the GPUs
])
def test_matrix_variants(text, pairs, boards) -> None:
    profile = parse_outputs({TOPO: text})
    assert profile.nvlink.pairs == pairs
    assert profile.boards == boards
    assert profile.warnings == []


def test_matrix_rows_that_disagree_with_the_header_are_warned_and_read_in_part() -> None:
    text = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
            "GPU0\t X \tNV2\n"  # two cells short
            "GPU1\tNV2\t X \tPHB\tSYS\tNV1\t0-7\n"  # two cells too many
            "GPU2\tPHB\tPHB\t X \t0-7\n")
    profile = parse_outputs({TOPO: text})
    assert profile.nvlink.pairs == [(0, 1, 2)]
    assert profile.warnings == [
        f"{TOPO} line 2: row GPU0 has 2 link cells, the header names 3 columns; read the cells that line up",
        f"{TOPO} line 3: row GPU1 has 5 link cells, the header names 3 columns; ignored the extra cells",
    ]


def test_asymmetric_cells_keep_the_larger_count_and_say_so() -> None:
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV1\t X \n"
    profile = parse_outputs({TOPO: text})
    assert profile.nvlink.pairs == [(0, 1, 2)]
    assert profile.warnings == [f"{TOPO} line 3: GPU1-GPU0 reads NV1 but GPU0-GPU1 reads NV2; kept the larger link count"]


def test_prompt_lines_and_ansi_around_the_matrix_are_ignored() -> None:
    text = ("\x1b[1;32muser@box\x1b[0m:~$ nvidia-smi topo -m\n"
            "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\x1b[0m\n"
            "GPU0\t X \tNV6\t0-15\n"
            "GPU1\tNV6\t X \t0-15\n")
    profile = parse_outputs({TOPO: text})
    assert profile.nvlink.pairs == [(0, 1, 6)]
    assert profile.warnings == []


def test_text_without_a_matrix_is_warned() -> None:
    profile = parse_outputs({TOPO: "topo: command not understood\n"})
    assert profile.nvlink.pairs == []
    assert profile.warnings == [f"{TOPO}: no topo matrix found (expected a header row naming GPU0 ...)"]


# ----------------------------------------------------------------------------------------- nvlink -s


def test_nvlink_status_agrees_with_the_dgx1_matrix(real_fixtures) -> None:
    outputs = machine("dgx1-8xv100")
    outputs[TOPO] = real_text(real_fixtures, "topo-8xv100-dgx1-hybrid-cube-mesh-4mlx5-tabs-trailing-tab.txt")
    profile = parse_outputs(outputs)
    assert profile.nvlink.pairs == DGX1_PAIRS
    assert profile.boards == [list(range(8))]
    assert profile.warnings == []


def test_nvlink_status_disagreeing_with_the_matrix_points_at_a_faulty_link(real_fixtures) -> None:
    outputs = machine("dgx1-8xv100")
    outputs[TOPO] = real_text(real_fixtures, "topo-8xv100-dgx1-hybrid-cube-mesh-4mlx5-tabs-trailing-tab.txt")
    lines = outputs[NVLINK].splitlines()
    gpu3 = lines.index(next(line for line in lines if line.startswith("GPU 3:")))
    lines[gpu3 + 1] = "\t Link 0: <inactive>"
    outputs[NVLINK] = "\n".join(lines) + "\n"
    profile = parse_outputs(outputs)
    assert warnings_about(profile, NVLINK) == [
        f"{NVLINK} line {gpu3 + 1}: GPU 3 has 5 active NVLinks but {TOPO} shows 6; a bridge or link may be faulty"]


def test_two_linked_gpus_without_a_matrix_are_paired_from_nvlink_status() -> None:
    profile = parse_outputs({NVLINK: machine("dual-v100-nvlink-windows-tcc")[NVLINK]})
    assert profile.nvlink.pairs == [(0, 1, 2)]
    assert profile.boards == [[0, 1]]
    assert [gpu.name for gpu in profile.gpus] == ["Tesla V100-SXM2-16GB"] * 2  # names from nvlink -s alone


def test_many_linked_gpus_without_a_matrix_are_not_guessed() -> None:
    outputs = machine("dgx1-8xv100")
    profile = parse_outputs(outputs)
    assert profile.nvlink.pairs == []
    assert profile.boards == [[i] for i in range(8)]
    assert warnings_about(profile, NVLINK) == [
        (f"{NVLINK}: GPUs [0, 1, 2, 3, 4, 5, 6, 7] have active NVLinks, but without {TOPO} the pairs are unknown; "
         "boards not derived")]


def test_gpu_with_no_links_and_odd_link_states() -> None:
    text = ("GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-aaaa)\n"
            "NVML: Unable to retrieve NVLink information as all links are inActive\n"
            "GPU 1: Tesla V100-SXM2-32GB (UUID: GPU-bbbb)\n"
            "\t Link 0: 25.781 GB/s\n"
            "\t Link 1: flaky\n")
    profile = parse_outputs({NVLINK: text})
    assert profile.nvlink.pairs == []
    assert profile.warnings == [f"{NVLINK} line 5: link state 'flaky' not understood; counted as inactive"]


# -------------------------------------------------------------------------------------------- boards


def test_boards_are_sorted_connected_groups_with_lone_gpus() -> None:
    pairs = [(9, 8, 2), (4, 5, 2), (5, 8, 2), (0, 1, 6), (10, 11, 2), (6, 7, 2), (7, 10, 2), (2, 3, 0)]
    assert boards(range(12), pairs) == [[0, 1], [2], [3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert boards([], []) == []


def test_pair_naming_a_gpu_nvidia_smi_does_not_list_is_dropped() -> None:
    outputs = {TOPO: "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV2\t X \n",
               "nvidia-smi-query.csv": "index, name\n0, Tesla V100-SXM2-16GB\n"}
    profile = parse_outputs(outputs)
    assert profile.nvlink.pairs == [] and profile.boards == [[0]]
    assert profile.warnings == [f"{TOPO}: NVLink pair GPU0-GPU1 names a GPU that nvidia-smi does not list; ignored"]
