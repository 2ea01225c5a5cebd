"""A box with V100s but no driver: the PCI bus still shows the cards, and the plan can use them."""

from controller.stages.probe.lspci import parse_lspci
from controller.stages.probe.parse import parse_outputs
from controller.stages.probe.text import Warnings

WITH_NAMES = """\
0000:3b:00.0 3D controller [0302]: NVIDIA Corporation GV100GL [Tesla V100 PCIe 32GB] [10de:1db6] (rev a1)
0000:3b:00.1 Audio device [0403]: NVIDIA Corporation Device [10de:10f7] (rev a1)
0000:d8:00.0 3D controller [0302]: NVIDIA Corporation GV100GL [Tesla V100 SXM2 16GB] [10de:1db1] (rev a1)
"""
WITHOUT_DB = "0000:86:00.0 3D controller [0302]: Device [10de:1db5] (rev a1)\n"
UNKNOWN_CARD = "01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GA102 [GeForce RTX 3090] [10de:2204]\n"


def test_display_controllers_only_with_names_and_memory_from_the_device_id():
    warnings = Warnings()
    gpus = parse_lspci(WITH_NAMES, warnings)
    assert [(g.pci_bus_id, g.name, g.memory_mib) for g in gpus] == [
        ("00000000:3B:00.0", "Tesla V100-PCIE-32GB", 32768),
        ("00000000:D8:00.0", "Tesla V100-SXM2-16GB", 16384),
    ]
    assert not warnings.items


def test_without_the_pci_database_and_an_unknown_card():
    warnings = Warnings()
    assert [g.name for g in parse_lspci(WITHOUT_DB, warnings)] == ["Tesla V100-SXM2-32GB"]
    (other,) = parse_lspci(UNKNOWN_CARD, warnings)
    assert (other.pci_bus_id, other.name, other.memory_mib) == ("00000000:01:00.0", "GeForce RTX 3090", None)


def test_garbage_lines_warn_and_are_skipped():
    warnings = Warnings()
    assert parse_lspci("lspci: command failed\n" + WITHOUT_DB, warnings)[0].device_id == "1db5"
    assert "not an lspci -nn line" in warnings.items[0]


def test_profile_of_a_box_without_driver_lists_the_v100s_and_says_why():
    profile = parse_outputs({"lspci.txt": WITH_NAMES, "nvidia-smi.txt": ""})
    assert [(g.index, g.name, g.compute_capability) for g in profile.gpus] == [
        (0, "Tesla V100-PCIE-32GB", "7.0"), (1, "Tesla V100-SXM2-16GB", "7.0")]
    assert profile.driver.version is None
    assert any("no driver is loaded" in warning for warning in profile.warnings)


def test_nvidia_smi_wins_over_the_bus():
    csv = ("index, name, memory.total [MiB]\n0, Tesla V100-PCIE-32GB, 32768 MiB\n")
    profile = parse_outputs({"nvidia-smi-query.csv": csv, "lspci.txt": WITH_NAMES})
    assert len(profile.gpus) == 1
    assert not any("PCI bus" in warning for warning in profile.warnings)


def test_windows_box_without_driver_lists_v100s_from_plug_and_play():
    import json

    cim = {"Processor": [{"Name": "Xeon", "NumberOfCores": 8, "NumberOfLogicalProcessors": 16}],
           "OperatingSystem": {"Caption": "Microsoft Windows 11 Pro", "Version": "10.0.22631"},
           "NvidiaPci": {"Name": "3D Video Controller",
                         "PNPDeviceID": "PCI\\VEN_10DE&DEV_1DB5&SUBSYS_124910DE&REV_A1\\4&2B8260C3&0&0010"}}
    profile = parse_outputs({"windows-cim.json": json.dumps(cim)})
    assert [(g.name, g.memory_mib, g.pci_bus_id) for g in profile.gpus] == [("Tesla V100-SXM2-32GB", 32768, None)]
    assert any(w.startswith("windows-cim.json: 1 NVIDIA GPU(s)") for w in profile.warnings)
