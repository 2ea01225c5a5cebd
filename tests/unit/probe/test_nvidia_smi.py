"""nvidia-smi CSV and table parsing: every layout people paste, and the ways the output goes wrong."""

from __future__ import annotations

from controller.stages.probe import parse_outputs
from tests.unit.probe.helpers import machine, real_text, warnings_about

CSV = "nvidia-smi-query.csv"
TABLE = "nvidia-smi.txt"


# ---------------------------------------------------------------------------------------------- CSV


def test_csv_in_the_probe_order_gives_every_contract_field() -> None:
    profile = parse_outputs({CSV: machine("twelve-v100-threadripper")[CSV]})
    assert len(profile.gpus) == 12
    third = profile.gpus[3]
    assert third.name == "Tesla V100-SXM2-16GB"
    assert third.memory_mib == 16384
    assert third.compute_capability == "7.0"
    assert third.pci_bus_id == "00000000:22:00.0"
    assert third.uuid is not None and third.uuid.startswith("GPU-")
    assert third.serial == "0323018000003"
    assert third.power_limit_w == 300.0
    assert third.temperature_c == 33.0
    assert profile.driver.version == "580.95.05"
    assert profile.driver.model is None  # Linux prints [N/A] for driver_model.current
    assert profile.warnings == []


def test_csv_columns_in_any_order_and_subset_with_units_and_placeholders() -> None:
    text = (
        "temperature.gpu, memory.total [MiB], name, index, driver_model.current, serial, power.limit [W]\n"
        "[N/A], 32764 MiB, Tesla V100-PCIE-32GB, 1, [Not Supported], [N/A], 250.00 W\n"
        "41, 16160 MiB, Tesla V100-SXM2-16GB, 0, TCC, 0323617023541, [Not Supported]\n"
    )
    profile = parse_outputs({CSV: text})
    assert [gpu.index for gpu in profile.gpus] == [0, 1]
    first, second = profile.gpus
    assert (second.name, second.memory_mib, second.temperature_c, second.serial) == (
        "Tesla V100-PCIE-32GB", 32764, None, None)
    assert second.power_limit_w == 250.0
    assert (first.memory_mib, first.temperature_c, first.power_limit_w) == (16160, 41.0, None)
    assert first.compute_capability == "7.0"  # not queried: known from the name
    assert profile.driver.model == "TCC"
    assert profile.warnings == []


def test_csv_without_units_in_header_reads_values_with_units() -> None:
    text = "index, name, memory.total\n0, Tesla V100-SXM2-32GB, 32 GiB\n"
    assert parse_outputs({CSV: text}).gpus[0].memory_mib == 32768


def test_real_sampled_csv_keeps_one_reading_and_says_the_gpu_is_unknown(real_fixtures) -> None:
    # nvidia-smi -lms: five samples of one A10, no index or name column.
    profile = parse_outputs({CSV: real_text(real_fixtures, "smi-query-a10-timestamp-pstate-util-mem.csv")})
    assert len(profile.gpus) == 1
    assert profile.gpus[0].memory_mib == 23028
    assert profile.gpus[0].temperature_c == 25.0
    assert profile.gpus[0].name == "Unknown GPU"
    assert profile.gpus[0].compute_capability is None
    csv_warnings = warnings_about(profile, CSV)
    assert any("line 3" in w and "repeated samples" in w for w in csv_warnings)
    assert any("no name" in w for w in csv_warnings)


def test_csv_row_with_missing_fields_is_read_as_far_as_it_goes() -> None:
    text = ("index, name, memory.total [MiB], pci.bus_id\n"
            "0, Tesla V100-SXM2-32GB, 32768 MiB, 00000000:1A:00.0\n"
            "1, Tesla V100-SXM2-32GB\n")
    profile = parse_outputs({CSV: text})
    assert [(gpu.index, gpu.memory_mib) for gpu in profile.gpus] == [(0, 32768), (1, None)]
    assert f"{CSV} line 3: row has 2 fields, header has 4; read the fields that line up" in profile.warnings


def test_csv_from_an_old_driver_that_rejects_compute_cap() -> None:
    text = 'Field "compute_cap" is not a valid field to query.\n\n'
    profile = parse_outputs({CSV: text})
    assert profile.gpus == []
    assert profile.warnings == [(f"{CSV} line 1: not a --query-gpu CSV header: "
                                 "'Field \"compute_cap\" is not a valid field to query.'")]


def test_csv_error_line_before_a_good_csv_is_skipped_with_a_warning() -> None:
    text = ('Field "compute_cap" is not a valid field to query.\n'
            "index, name, memory.total [MiB]\n0, Tesla V100-SXM2-16GB, 16160 MiB\n")
    profile = parse_outputs({CSV: text})
    assert [gpu.name for gpu in profile.gpus] == ["Tesla V100-SXM2-16GB"]
    assert any(w.startswith(f"{CSV} line 1: text before the CSV header") for w in profile.warnings)


def test_csv_without_header_is_refused_with_the_fix() -> None:
    profile = parse_outputs({CSV: "0, GPU-1, Tesla V100-SXM2-16GB, 16160 MiB\n"})
    assert profile.gpus == []
    assert profile.warnings == [f"{CSV} line 1: no header row (use --format=csv, not noheader)"]


def test_csv_bad_index_and_duplicate_rows() -> None:
    text = "index, name\nzero, Tesla V100-SXM2-16GB\n1, Tesla V100-SXM2-16GB\n1, Tesla V100-SXM2-32GB\n"
    profile = parse_outputs({CSV: text})
    assert [(g.index, g.name) for g in profile.gpus] == [(0, "Tesla V100-SXM2-16GB"), (1, "Tesla V100-SXM2-16GB")]
    assert any("line 2" in w and "'zero' is not a number" in w for w in profile.warnings)
    assert any("line 4" in w and "repeated readings" in w for w in profile.warnings)


# -------------------------------------------------------------------------------------------- table


def test_table_before_r530_with_truncated_names(real_fixtures) -> None:
    text = real_text(real_fixtures, "smi-8xv100-sxm2-azure-nd40rsv2-linux-520-truncated-names.txt")
    profile = parse_outputs({TABLE: text})
    assert len(profile.gpus) == 8
    assert {gpu.name for gpu in profile.gpus} == {"Tesla V100-SXM2..."}
    assert all(gpu.is_v100 and gpu.compute_capability == "7.0" for gpu in profile.gpus)
    assert [gpu.memory_mib for gpu in profile.gpus] == [32768] * 8
    assert profile.gpus[7].pci_bus_id == "00000008:00:00.0"
    assert profile.gpus[0].temperature_c == 34.0 and profile.gpus[0].power_limit_w == 300.0
    assert (profile.driver.version, profile.driver.cuda_version) == ("520.61.05", "11.8")
    table_warnings = warnings_about(profile, TABLE)
    assert any("line 9" in w and "cut short" in w and "GPU 0, 1, 2, 3, 4, 5, 6, 7" in w for w in table_warnings)
    assert any("line 3" in w and "520.61.05" in w and "older than R570" in w for w in table_warnings)


def test_table_r535_layout_dual_pcie_32gb(real_fixtures) -> None:
    profile = parse_outputs({TABLE: real_text(real_fixtures, "smi-2xv100-pcie-32gb-linux-535-no-processes.txt")})
    assert [(g.index, g.name, g.memory_mib, g.pci_bus_id) for g in profile.gpus] == [
        (0, "Tesla V100-PCIE-32GB", 32768, "00000000:04:00.0"),
        (1, "Tesla V100-PCIE-32GB", 32768, "00000000:1B:00.0"),
    ]
    assert profile.driver.version == "535.104.05" and profile.driver.cuda_version == "12.2"
    assert profile.boards == [[0], [1]]


def test_table_r555_layout_with_a_3090_beside_two_v100(real_fixtures) -> None:
    profile = parse_outputs({TABLE: real_text(real_fixtures, "smi-2xv100-sxm2-plus-3090-linux-580.txt")})
    assert [(g.name, g.memory_mib, g.compute_capability) for g in profile.gpus] == [
        ("NVIDIA GeForce RTX 3090", 24576, "8.6"),
        ("Tesla V100-SXM2-32GB", 32768, "7.0"),
        ("Tesla V100-SXM2-32GB", 32768, "7.0"),
    ]
    assert profile.gpus[0].power_limit_w == 370.0
    assert (profile.driver.version, profile.driver.cuda_version, profile.driver.model) == ("580.95.05", "13.0", None)
    assert profile.warnings == []  # R580 is inside the window


def test_table_windows_driver_model_column(real_fixtures) -> None:
    profile = parse_outputs({TABLE: real_text(real_fixtures, "smi-windows-wddm-driver-model-rtx3050-560.txt")})
    assert profile.driver.model == "WDDM"
    assert profile.os.family == "windows"  # only nvidia-smi.exe prints a driver model
    assert profile.gpus[0].name == "NVIDIA GeForce RTX 3050 ..."
    assert profile.gpus[0].memory_mib == 6144
    assert profile.driver.version == "560.78"


def test_table_wsl2_smi_version_differs_from_driver(real_fixtures) -> None:
    profile = parse_outputs({TABLE: real_text(real_fixtures, "smi-wsl2-rtx4060ti-smi545-driver546-xwayland.txt")})
    assert profile.driver.version == "546.12"  # the Windows host's driver, not the smi build 545.23.07
    assert profile.os.wsl is True and profile.os.family == "linux"
    assert profile.gpus[0].name == "NVIDIA GeForce RTX 4060 Ti" and profile.gpus[0].memory_mib == 8188
    assert any("on the Windows host" in w for w in profile.warnings)


def test_table_windows_tcc_written_fixture() -> None:
    profile = parse_outputs({TABLE: machine("dual-v100-nvlink-windows-tcc")[TABLE]})
    assert profile.driver.model == "TCC"
    assert profile.driver.version == "573.96"
    assert [g.memory_mib for g in profile.gpus] == [16384, 16384]
    assert profile.warnings == []


def test_table_alone_gives_the_gpus() -> None:
    profile = parse_outputs({TABLE: machine("single-v100-32g-table-only")[TABLE]})
    assert [(g.name, g.memory_mib, g.pci_bus_id) for g in profile.gpus] == [
        ("Tesla V100-PCIE-32GB", 32764, "00000000:3B:00.0")]
    assert profile.driver.cuda_version == "12.9"


def test_table_cut_short_by_a_crash() -> None:
    profile = parse_outputs({TABLE: machine("cut-short-table")[TABLE]})
    assert [(g.index, g.memory_mib) for g in profile.gpus] == [(0, 32768), (1, None)]
    assert profile.warnings == [
        (f"{TABLE} line 2: nvidia-smi could not reach a GPU (fallen off the bus?): "
         "'Unable to determine the device handle for GPU0000:3D:00.0: Unknown Error'"),
        f"{TABLE} line 15: the table ends before GPU 1's usage line (output cut short?); its memory is unknown",
    ]


def test_table_messages_instead_of_a_table() -> None:
    driver_gone = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
                   "the latest NVIDIA driver is installed and running.\n")
    profile = parse_outputs({TABLE: driver_gone})
    assert profile.gpus == []
    assert len(profile.warnings) == 1 and "the NVIDIA driver is not loaded" in profile.warnings[0]
    assert parse_outputs({TABLE: "No devices were found\n"}).warnings[0].startswith(
        f"{TABLE} line 1: nvidia-smi found no GPUs")


def test_csv_wins_over_table_and_table_adds_cuda_version() -> None:
    outputs = machine("twelve-v100-threadripper")
    profile = parse_outputs({CSV: outputs[CSV], TABLE: outputs[TABLE]})
    assert profile.driver.cuda_version == "13.0"
    assert profile.gpus[0].serial == "0323018000000"  # only the CSV has serials
    assert profile.warnings == []


def test_csv_and_table_disagreeing_on_the_gpus_is_reported() -> None:
    outputs = machine("twelve-v100-threadripper")
    csv_lines = outputs[CSV].splitlines()
    fewer = "\n".join(csv_lines[:-1]) + "\n"  # GPU 11 missing from the CSV
    profile = parse_outputs({CSV: fewer, TABLE: outputs[TABLE]})
    assert len(profile.gpus) == 12
    assert profile.warnings == [(f"{CSV}: the GPUs differ from {TABLE} (GPU 11 only in {TABLE}); a GPU may have "
                                 "dropped off the bus between the two commands")]


def test_table_old_windows_layout_with_tcc_wddm_header_and_err_cells() -> None:
    text = (
        "+-----------------------------------------------------------------------------+\r\n"
        "| NVIDIA-SMI 472.98       Driver Version: 472.98       CUDA Version: 11.4     |\r\n"
        "|-------------------------------+----------------------+----------------------+\r\n"
        "| GPU  Name            TCC/WDDM | Bus-Id        Disp.A | Volatile Uncorr. ECC |\r\n"
        "| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |\r\n"
        "|                               |                      |               MIG M. |\r\n"
        "|===============================+======================+======================|\r\n"
        "|   0  Tesla V100-SXM2...  TCC  | 00000000:00:1E.0 Off |                    0 |\r\n"
        "| N/A   39C    P0    38W / 300W |      0MiB / 16160MiB |      0%      Default |\r\n"
        "+-------------------------------+----------------------+----------------------+\r\n"
        "|   1  Tesla V100-SXM2...  TCC  | 00000000:00:1F.0 Off |                 ERR! |\r\n"
        "|ERR!  ERR!  ERR!   ERR! / ERR! |      0MiB / 16160MiB |    ERR!      Default |\r\n"
        "+-------------------------------+----------------------+----------------------+\r\n"
    )
    profile = parse_outputs({TABLE: text})
    assert profile.driver.model == "TCC" and profile.os.family == "windows"
    assert [(g.index, g.memory_mib, g.temperature_c) for g in profile.gpus] == [(0, 16160, 39.0), (1, 16160, None)]
    assert [g.pci_bus_id for g in profile.gpus] == ["00000000:00:1E.0", "00000000:00:1F.0"]
    assert any("older than R570" in w for w in profile.warnings)


def test_crlf_table_reads_like_lf() -> None:
    text = machine("dual-v100-nvlink-windows-tcc")[TABLE]
    lf, crlf = parse_outputs({TABLE: text}), parse_outputs({TABLE: text.replace("\n", "\r\n")})
    assert crlf.model_dump() == lf.model_dump()


def test_table_gpu_row_missing_cells_keeps_what_it_has() -> None:
    lines = machine("single-v100-16g-linux")[TABLE].splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("|   0  "))
    lines[row] = "|   0  Tesla V100-SXM2-16GB           Off |"
    profile = parse_outputs({TABLE: "\n".join(lines) + "\n"})
    assert [(g.name, g.memory_mib, g.pci_bus_id) for g in profile.gpus] == [("Tesla V100-SXM2-16GB", 16384, None)]
    assert profile.warnings == [f"{TABLE} line {row + 1}: GPU 0 row has no PCI bus id"]
