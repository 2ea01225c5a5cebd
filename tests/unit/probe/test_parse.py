"""Whole-box profiles from every machine the seeds describe, the driver window, and bad input."""

from __future__ import annotations

import os
import random

import pytest

from controller.errors import ProbeError
from controller.stages.probe import PROBE_FILES, parse_outputs, read_dir
from controller.stages.probe.driver import driver_window_problem
from tests.unit.probe.helpers import WRITTEN, machine, real_text

MODELS = "/var/lib/llama/models"


def test_twelve_gpu_threadripper_box() -> None:
    profile = parse_outputs(machine("twelve-v100-threadripper"), model_dir=MODELS)
    assert len(profile.gpus) == 12
    assert [gpu.memory_mib for gpu in profile.gpus].count(16384) == 1
    assert profile.gpus[3].name == "Tesla V100-SXM2-16GB"
    assert profile.boards == [[0, 1], [2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert (0, 1, 6) in profile.nvlink.pairs and (2, 3, 6) in profile.nvlink.pairs
    assert (4, 9, 2) in profile.nvlink.pairs and (7, 11, 2) in profile.nvlink.pairs
    assert not any(i in (4, 5, 8, 9) and j in (6, 7, 10, 11) for i, j, _ in profile.nvlink.pairs)
    assert (profile.cpu.cores, profile.cpu.threads, profile.cpu.avx2, profile.cpu.avx512) == (32, 64, True, False)
    assert profile.memory_mib == 257594
    assert profile.driver.version == "580.95.05"
    assert profile.disks[0].path == MODELS
    assert profile.warnings == []


def test_single_v100_16g_linux_box() -> None:
    profile = parse_outputs(machine("single-v100-16g-linux"), model_dir=MODELS)
    assert [(g.name, g.memory_mib, g.compute_capability) for g in profile.gpus] == [
        ("Tesla V100-SXM2-16GB", 16384, "7.0")]
    assert profile.boards == [[0]] and profile.nvlink.pairs == []
    assert (profile.cpu.cores, profile.cpu.threads) == (6, 12)
    assert (profile.os.name, profile.os.version) == ("Ubuntu", "24.04")
    assert profile.driver.version == "570.172.08" and profile.driver.cuda_version == "12.8"
    assert profile.disks[0].free_mib == 722318468 // 1024
    assert profile.warnings == []


def test_dual_v100_nvlink_windows_tcc_box() -> None:
    profile = parse_outputs(machine("dual-v100-nvlink-windows-tcc"), model_dir="D:\\models")
    assert profile.os.family == "windows" and profile.os.wsl is False
    assert profile.driver.model == "TCC" and profile.driver.version == "573.96"
    assert profile.nvlink.pairs == [(0, 1, 2)]
    assert profile.boards == [[0, 1]]
    assert profile.disks[0].path == "D:\\models"
    assert profile.warnings == []


def test_windows_v100_not_in_tcc_gets_the_command_that_fixes_it() -> None:
    outputs = machine("dual-v100-nvlink-windows-tcc")
    outputs["nvidia-smi-query.csv"] = outputs["nvidia-smi-query.csv"].replace(", TCC,", ", MCDM,")
    outputs["nvidia-smi.txt"] = outputs["nvidia-smi.txt"].replace(" TCC  |", "MCDM  |")
    profile = parse_outputs(outputs)
    assert profile.driver.model == "MCDM"
    assert "nvidia-smi.txt: GPU 1 is in MCDM mode; native Windows serving wants TCC (much faster decode): run " \
           "'nvidia-smi -i 1 -dm 1' as administrator and reboot" in profile.warnings


def test_wsl2_box() -> None:
    profile = parse_outputs(machine("wsl2-v100-16g"), model_dir="/home/me/models")
    assert profile.os.family == "linux" and profile.os.wsl is True
    assert profile.driver.version == "573.96"  # the host driver: inside the window, no warning
    assert profile.driver.model is None
    assert profile.gpus[0].name == "Tesla V100-SXM2-16GB"
    assert profile.disks[0].path == "/home/me/models"
    assert profile.warnings == []


def test_epyc_box_with_3090s_and_pcie_v100s() -> None:
    profile = parse_outputs(machine("epyc-4x3090-2xv100-pcie"))
    assert [g.compute_capability for g in profile.gpus] == ["8.6"] * 4 + ["7.0"] * 2
    assert profile.boards == [[i] for i in range(6)]
    assert profile.memory_mib == 528184212 // 1024
    assert profile.warnings == []


def test_cpu_only_box_without_a_driver_is_normal() -> None:
    profile = parse_outputs(machine("cpu-only-no-driver"), model_dir=MODELS)
    assert profile.gpus == [] and profile.boards == []
    assert profile.driver.version is None
    assert profile.usable
    assert profile.warnings == []  # no driver is a normal state: the driver role installs it


def test_dual_v100_beside_a_3090(real_fixtures) -> None:
    outputs = machine("dual-v100-sxm2-plus-3090-linux")
    outputs["nvidia-smi.txt"] = real_text(real_fixtures, "smi-2xv100-sxm2-plus-3090-linux-580.txt")
    outputs["nvidia-smi-topo.txt"] = real_text(real_fixtures, "topo-2xv100-sxm2-nv6-plus-3090-ansi-escapes.txt")
    profile = parse_outputs(outputs)
    assert profile.nvlink.pairs == [(1, 2, 6)]
    assert profile.boards == [[0], [1, 2]]  # the 3090 is a board of its own
    assert profile.warnings == []


def test_aws_p3_box(real_fixtures) -> None:
    outputs = machine("aws-p3-8xlarge")
    outputs["nvidia-smi-topo.txt"] = real_text(real_fixtures, "topo-4xv100-aws-p3.8xlarge-nv1-nv2-tabs-double-tab-na.txt")
    profile = parse_outputs(outputs)
    assert profile.boards == [[0, 1, 2, 3]]
    assert sorted({links for _, _, links in profile.nvlink.pairs}) == [1, 2]
    assert [gpu.compute_capability for gpu in profile.gpus] == ["7.0"] * 4  # from the name: no compute_cap column
    assert profile.warnings == [
        ("nvidia-smi-query.csv line 3: driver 460.67 (R460) is older than R570, which the CUDA 12.8 sm_70 builds "
         "need (on older drivers they fall back to the CPU); install an R580 driver with the proprietary kernel "
         "modules (the open modules do not support Volta)")]


# ------------------------------------------------------------------------------------ driver window


@pytest.mark.parametrize(
    ("version", "os_family", "wsl", "expected"),
    [
        ("570.86.15", "linux", False, None),
        ("573.96", "windows", False, None),
        ("580.95.05", "linux", False, None),
        ("581.57", "windows", False, None),  # Windows releases of the R580 branch
        ("535.104.05", "linux", False, "older than R570"),
        ("552.22", "windows", False, "install the R570 data-center driver 573.96"),
        ("546.12", "linux", True, "on the Windows host"),
        ("590.44.01", "linux", False, "the last to support Volta"),
        ("weird", "linux", False, "not understood"),
    ],
)
def test_driver_window(version: str, os_family: str, wsl: bool, expected: str | None) -> None:
    problem = driver_window_problem(version, has_volta=True, os_family=os_family, wsl=wsl)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_newer_driver_only_matters_with_a_v100() -> None:
    assert driver_window_problem("595.10", has_volta=False, os_family="linux", wsl=False) is None


# ---------------------------------------------------------------------------------------- bad input


def test_empty_outputs_give_an_empty_unusable_profile() -> None:
    profile = parse_outputs({name: "" for name in PROBE_FILES})
    assert not profile.usable
    assert profile.warnings == []


@pytest.mark.parametrize("name", PROBE_FILES)
def test_binary_garbage_in_any_file_is_a_warning_and_the_rest_still_parses(name: str) -> None:
    outputs = machine("single-v100-16g-linux")
    outputs["windows-cim.json"] = ""
    outputs[name] = os.urandom(3000).decode("utf-8", errors="replace")
    profile = parse_outputs(outputs)
    assert any(warning.startswith(name) for warning in profile.warnings), profile.warnings
    if name not in ("nvidia-smi-query.csv", "nvidia-smi.txt"):
        assert profile.gpus[0].name == "Tesla V100-SXM2-16GB"
    if name not in ("cpuinfo",):
        assert profile.cpu.model == "AMD Ryzen 5 5600X 6-Core Processor"


def test_plain_text_junk_in_every_file_never_raises() -> None:
    junk = "lorem ipsum | GPU0 | X | NV | 12 | : = , [N/A]\n\t\t| 0 Tesla V100 On |\n{ not json\n" * 3
    profile = parse_outputs({name: junk for name in PROBE_FILES})
    assert isinstance(profile.warnings, list)
    assert all(" " in warning for warning in profile.warnings)


def test_unknown_gpu_is_listed_with_a_warning() -> None:
    text = "index, name, memory.total [MiB]\n0, NVIDIA Graphics Device, 32768 MiB\n"
    profile = parse_outputs({"nvidia-smi-query.csv": text})
    assert profile.gpus[0].name == "NVIDIA Graphics Device"
    assert profile.gpus[0].compute_capability is None
    assert profile.warnings == [
        ("nvidia-smi-query.csv line 2: GPU 0 (NVIDIA Graphics Device) is not a GPU model this probe knows; its "
         "compute capability is unknown and the planner will not use it")]


def test_unknown_output_name_is_ignored_with_a_warning() -> None:
    profile = parse_outputs({"dmesg.txt": "[    0.000000] Linux version 6.1"})
    assert profile.warnings == ["dmesg.txt: not a probe output this parser knows; ignored"]


def test_fixture_header_lines_are_skipped_everywhere() -> None:
    for folder in WRITTEN.iterdir():
        for file in folder.iterdir():
            assert file.read_text().startswith("# fixture: "), file
    profile = parse_outputs({name: "# fixture: nothing else\n" for name in PROBE_FILES})
    assert profile.warnings == [] and not profile.usable


# ----------------------------------------------------------------------------------------- read_dir


def test_read_dir_reads_known_names_utf16_and_txt_aliases(tmp_path) -> None:
    (tmp_path / "meminfo.txt").write_text("MemTotal:       16384000 kB\n")
    (tmp_path / "nvidia-smi.txt").write_bytes(machine("dual-v100-nvlink-windows-tcc")["nvidia-smi.txt"]
                                               .encode("utf-16"))  # what PowerShell 5.1 '>' writes
    (tmp_path / "cpuinfo").write_bytes(b"\xff\xfe\x00garbage\x80\x81")
    (tmp_path / "notes.md").write_text("not a probe file")
    outputs = read_dir(tmp_path)
    assert sorted(outputs) == ["cpuinfo", "meminfo", "nvidia-smi.txt"]
    profile = parse_outputs(outputs)
    assert profile.memory_mib == 16000
    assert profile.driver.model == "TCC" and len(profile.gpus) == 2


def test_read_dir_of_a_missing_folder_says_what_to_give(tmp_path) -> None:
    with pytest.raises(ProbeError, match="not a folder; give the folder that holds nvidia-smi.txt"):
        read_dir(tmp_path / "nope")


def _mutations(text: str, rng: random.Random) -> list[str]:
    lines = text.splitlines(keepends=True)
    cut = rng.randrange(len(text) + 1)
    dropped = [line for line in lines if rng.random() > 0.2]
    shuffled = lines[:]
    rng.shuffle(shuffled)
    noisy = "".join(line if rng.random() > 0.2 else line.replace("|", "").replace("\t", " ", 1) for line in lines)
    swapped = "".join(rng.choice((c, c, c, "|", "\t", ":", ",", "0", "X", "\n")) for c in text[:4000])
    return [text[:cut], "".join(dropped), "".join(shuffled), noisy, swapped]


def test_mangled_outputs_never_reach_the_safety_net(real_fixtures) -> None:
    """Truncated, shuffled and corrupted outputs: each parser copes itself, none needs the catch-all."""
    rng = random.Random(20260612)
    sources: dict[str, list[str]] = {name: [] for name in PROBE_FILES}
    for folder in WRITTEN.iterdir():
        for name, text in read_dir(folder).items():
            sources[name].append(text)
    for file in sorted(real_fixtures.iterdir()):
        if file.name.startswith("topo-"):
            sources["nvidia-smi-topo.txt"].append(real_text(real_fixtures, file.name))
        elif file.name.startswith("smi-") and file.suffix == ".csv":
            sources["nvidia-smi-query.csv"].append(real_text(real_fixtures, file.name))
        elif file.name.startswith("smi-"):
            sources["nvidia-smi.txt"].append(real_text(real_fixtures, file.name))
    checked = 0
    for name, texts in sources.items():
        for text in texts:
            for mangled in _mutations(text, rng):
                profile = parse_outputs({name: mangled})
                assert not [w for w in profile.warnings if "could not be parsed" in w], (name, mangled[:300])
                checked += 1
    assert checked > 300


def test_a_parser_that_breaks_costs_only_its_own_file(monkeypatch) -> None:
    def broken(text, warnings, file):
        raise ValueError("boom")

    monkeypatch.setattr("controller.stages.probe.parse.parse_topo", broken)
    profile = parse_outputs(machine("twelve-v100-threadripper"))
    assert len(profile.gpus) == 12 and profile.cpu.cores == 32
    assert profile.warnings[0] == "nvidia-smi-topo.txt: could not be parsed (ValueError: boom); ignored"
    assert profile.warnings[1].startswith("nvidia-smi-nvlink.txt: GPUs [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] have")


def test_outputs_as_bytes_or_none_are_accepted() -> None:
    outputs = machine("single-v100-16g-linux")
    mixed = {name: (text.encode() if name.endswith(".txt") else text) for name, text in outputs.items()}
    mixed["nvidia-smi-nvlink.txt"] = None
    profile = parse_outputs(mixed)
    assert profile.gpus[0].name == "Tesla V100-SXM2-16GB" and profile.disks and profile.cpu.cores == 6
