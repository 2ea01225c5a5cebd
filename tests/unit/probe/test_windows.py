"""windows-cim.json: the format WINDOWS_CIM_QUERY prints, and what PowerShell 5.1 really emits."""

from __future__ import annotations

import json

from controller.stages.probe import WINDOWS_CIM_QUERY, WINDOWS_PROBE_COMMANDS, parse_outputs
from tests.unit.probe.helpers import machine

CIM = "windows-cim.json"


def _fixture_object() -> dict:
    text = machine("dual-v100-nvlink-windows-tcc")[CIM]
    return json.loads(text[text.index("{"):])


def test_cim_fixture_gives_cpu_memory_os_and_disks() -> None:
    profile = parse_outputs({CIM: machine("dual-v100-nvlink-windows-tcc")[CIM]}, model_dir="D:\\llama\\models")
    assert (profile.os.family, profile.os.name, profile.os.version, profile.os.wsl) == (
        "windows", "Microsoft Windows 11 Pro", "10.0.26100", False)
    assert profile.cpu.model == "AMD Ryzen 9 5900X 12-Core Processor"  # CIM pads the name with spaces
    assert (profile.cpu.cores, profile.cpu.threads) == (12, 24)
    assert (profile.cpu.avx2, profile.cpu.avx512) == (True, False)
    assert profile.memory_mib == 68619431936 // 2**20
    assert [(d.path, d.filesystem, d.free_mib) for d in profile.disks] == [
        ("D:\\llama\\models", "NTFS", 1649267441664 // 2**20),  # the model drive first, with the model dir
        ("C:\\", "NTFS", 201327435776 // 2**20),
    ]
    assert profile.warnings == []


def test_powershell_51_quirks_bom_noise_single_objects_and_value_wrappers() -> None:
    data = _fixture_object()
    data["Processor"] = data["Processor"][0]  # a one-element array collapsed to a bare object
    data["LogicalDisk"] = {"value": data["LogicalDisk"], "Count": 2}
    text = "\ufeff#< CLIXML\r\n" + json.dumps(data, indent=4).replace("\n", "\r\n")
    profile = parse_outputs({CIM: text})
    assert (profile.cpu.cores, profile.cpu.threads) == (12, 24)
    assert [disk.path for disk in profile.disks] == ["C:\\", "D:\\"]
    assert profile.warnings == []


def test_two_sockets_add_up_and_missing_features_mean_no_avx_claim() -> None:
    data = _fixture_object()
    data["Processor"] = [{"Name": "Intel(R) Xeon(R) Gold 6130 CPU @ 2.10GHz", "NumberOfCores": 16,
                          "NumberOfLogicalProcessors": 32}] * 2
    data["ProcessorFeatures"] = {}
    del data["ComputerSystem"]
    profile = parse_outputs({CIM: json.dumps(data)})
    assert (profile.cpu.cores, profile.cpu.threads) == (32, 64)
    assert profile.cpu.avx2 is False and profile.cpu.flags == []
    assert profile.memory_mib == 2 * 34359738368 // 2**20  # from the memory modules when the total is absent


def test_broken_json_is_a_warning_with_the_line() -> None:
    profile = parse_outputs({CIM: '{"Processor": [{"Name": "x",\n "NumberOfCores": }]}'})
    assert profile.os.family is None
    assert profile.warnings == [
        f"{CIM} line 2: not valid JSON (Expecting value); expected the output of WINDOWS_CIM_QUERY"]
    assert parse_outputs({CIM: "Get-CimInstance : Access denied\n"}).warnings == [
        f"{CIM}: no JSON object found; expected the output of WINDOWS_CIM_QUERY"]


def test_query_reads_every_class_the_parser_uses() -> None:
    for cim_class in ("Win32_Processor", "Win32_ComputerSystem", "Win32_PhysicalMemory", "Win32_LogicalDisk",
                      "Win32_OperatingSystem", "IsProcessorFeaturePresent", "ConvertTo-Json"):
        assert cim_class in WINDOWS_CIM_QUERY
    assert WINDOWS_PROBE_COMMANDS[CIM] == WINDOWS_CIM_QUERY
    assert "nvidia-smi.exe --query-gpu=index,uuid,name,serial,pci.bus_id,memory.total,compute_cap" in (
        WINDOWS_PROBE_COMMANDS["nvidia-smi-query.csv"])
