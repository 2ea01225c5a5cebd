"""The Windows side of the probe: one PowerShell CIM query, and the parser of what it prints.

``windows-cim.json`` is the single JSON object printed by :data:`WINDOWS_CIM_QUERY`::

    {
      "Processor":       [{"Name": "Intel(R) Xeon(R) ...", "NumberOfCores": 8,
                           "NumberOfLogicalProcessors": 16, "Manufacturer": "GenuineIntel"}],
      "ComputerSystem":  {"TotalPhysicalMemory": 68448722944, "NumberOfProcessors": 1,
                          "Manufacturer": "...", "Model": "..."},
      "PhysicalMemory":  [{"Capacity": 34359738368}, {"Capacity": 34359738368}],
      "LogicalDisk":     [{"DeviceID": "C:", "FileSystem": "NTFS", "Size": 999..., "FreeSpace": 512...,
                           "VolumeName": ""}],
      "OperatingSystem": {"Caption": "Microsoft Windows 11 Pro", "Version": "10.0.22631",
                          "BuildNumber": "22631", "OSArchitecture": "64-bit"},
      "ProcessorFeatures": {"avx": true, "avx2": true, "avx512f": false}
    }

Win32_Processor, Win32_ComputerSystem, Win32_PhysicalMemory, Win32_LogicalDisk (DriveType=3: local
fixed disks) and Win32_OperatingSystem are the CIM classes (plus Win32_PnPEntity for NVIDIA cards on the PCI bus,
which show up even when no driver is installed); ``ProcessorFeatures`` comes from the Win32
``IsProcessorFeaturePresent`` call (PF_AVX_INSTRUCTIONS_AVAILABLE=39, PF_AVX2_...=40,
PF_AVX512F_...=41), because CIM has no CPU flags and the prebuilt binaries need AVX2. Windows builds
older than 10 2004 do not know features 39-41 and report false; the parser then says AVX2 is
unknown rather than absent.

The parser is lenient about what PowerShell 5.1 really prints: a byte-order mark, CLIXML progress
noise before the object, a one-element array collapsed to a bare object, and arrays wrapped as
``{"value": [...], "Count": n}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from controller.stages.probe.text import Warnings, has_content, looks_binary, shorten

WINDOWS_CIM_QUERY = r"""
$ErrorActionPreference = 'SilentlyContinue'
$ProgressPreference = 'SilentlyContinue'
$features = @{}
try {
  if (-not ('V100Probe.Cpu' -as [type])) {
    Add-Type -Namespace V100Probe -Name Cpu -MemberDefinition (
      '[DllImport("kernel32.dll")] public static extern bool IsProcessorFeaturePresent(uint feature);')
  }
  $features = @{
    avx = [V100Probe.Cpu]::IsProcessorFeaturePresent(39)
    avx2 = [V100Probe.Cpu]::IsProcessorFeaturePresent(40)
    avx512f = [V100Probe.Cpu]::IsProcessorFeaturePresent(41)
  }
} catch { }
[pscustomobject]@{
  Processor = @(Get-CimInstance Win32_Processor | Select-Object Name, NumberOfCores, NumberOfLogicalProcessors, Manufacturer)
  ComputerSystem = Get-CimInstance Win32_ComputerSystem | Select-Object TotalPhysicalMemory, NumberOfProcessors, Manufacturer, Model
  PhysicalMemory = @(Get-CimInstance Win32_PhysicalMemory | Select-Object Capacity)
  LogicalDisk = @(Get-CimInstance Win32_LogicalDisk -Filter 'DriveType=3' | Select-Object DeviceID, FileSystem, Size, FreeSpace, VolumeName)
  OperatingSystem = Get-CimInstance Win32_OperatingSystem | Select-Object Caption, Version, BuildNumber, OSArchitecture
  NvidiaPci = @(Get-CimInstance Win32_PnPEntity -Filter "PNPDeviceID LIKE 'PCI\\VEN_10DE%'" | Where-Object { $_.PNPClass -in @('Display', $null, '') } | Select-Object Name, PNPDeviceID)
  ProcessorFeatures = $features
} | ConvertTo-Json -Depth 4 -Compress
""".strip()
"""PowerShell (5.1 or 7) that prints ``windows-cim.json``: read-only, one round trip, no modules needed."""

FILE = "windows-cim.json"


@dataclass
class WindowsDisk:
    device: str  # "C:"
    filesystem: str | None
    total_mib: int | None
    free_mib: int | None


@dataclass
class WindowsFacts:
    cpu_model: str | None = None
    cores: int | None = None
    threads: int | None = None
    flags: list[str] = field(default_factory=list)
    features_known: bool = False
    memory_mib: int | None = None
    os_name: str | None = None
    os_version: str | None = None
    disks: list[WindowsDisk] = field(default_factory=list)
    nvidia_pci: list[tuple[str, str | None]] = field(default_factory=list)  # (device id, name): seen without a driver
    found: bool = False


def parse_windows_cim(text: str, warnings: Warnings, file: str = FILE) -> WindowsFacts:
    facts = WindowsFacts()
    if not has_content(text):
        return facts
    if looks_binary(text):
        warnings.add(file, None, "is not text (binary data); ignored")
        return facts
    data = _first_json_object(text, warnings, file)
    if data is None:
        return facts
    facts.found = True
    _read_processors(_as_list(data.get("Processor")), facts, warnings, file)
    _read_features(data.get("ProcessorFeatures"), facts)
    _read_memory(data.get("ComputerSystem"), _as_list(data.get("PhysicalMemory")), facts)
    _read_os(data.get("OperatingSystem"), facts)
    _read_disks(_as_list(data.get("LogicalDisk")), facts, warnings, file)
    for device in _as_list(data.get("NvidiaPci")):
        match = re.search(r"VEN_10DE&DEV_([0-9A-Fa-f]{4})", _as_str(device.get("PNPDeviceID")) or "")
        if match:
            facts.nvidia_pci.append((match.group(1).lower(), _as_str(device.get("Name"))))
    return facts


def _first_json_object(text: str, warnings: Warnings, file: str) -> dict[str, Any] | None:
    text = text.lstrip("\ufeff")
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError as exc:
            line = text.count("\n", 0, exc.pos) + 1
            warnings.add(file, line, f"not valid JSON ({exc.msg}); expected the output of WINDOWS_CIM_QUERY")
            return None
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    warnings.add(file, None, "no JSON object found; expected the output of WINDOWS_CIM_QUERY")
    return None


def _as_list(value: Any) -> list[dict[str, Any]]:
    """PowerShell 5.1 collapses one-element arrays and sometimes wraps arrays as {value, Count}."""
    if isinstance(value, dict) and isinstance(value.get("value"), list) and "Count" in value:
        value = value["value"]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, dict)]
    return []


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _as_str(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return " ".join(value.split())
    return None


def _read_processors(processors: list[dict[str, Any]], facts: WindowsFacts, warnings: Warnings, file: str) -> None:
    if not processors:
        warnings.add(file, None, "no Processor entries")
        return
    facts.cpu_model = _as_str(processors[0].get("Name"))
    cores = [_as_int(item.get("NumberOfCores")) for item in processors]
    threads = [_as_int(item.get("NumberOfLogicalProcessors")) for item in processors]
    facts.cores = sum(c for c in cores if c) or None
    facts.threads = sum(t for t in threads if t) or None
    if facts.cores is None or facts.threads is None:
        warnings.add(file, None, "Processor entries lack NumberOfCores or NumberOfLogicalProcessors")


def _read_features(features: Any, facts: WindowsFacts) -> None:
    if not isinstance(features, dict) or not features:
        return
    facts.features_known = any(value is True for value in features.values())
    facts.flags = sorted(name.lower() for name, value in features.items() if value is True)


def _read_memory(system: Any, modules: list[dict[str, Any]], facts: WindowsFacts) -> None:
    total = _as_int(system.get("TotalPhysicalMemory")) if isinstance(system, dict) else None
    if total is None:
        capacities = [_as_int(module.get("Capacity")) for module in modules]
        total = sum(c for c in capacities if c) or None
    facts.memory_mib = None if total is None else total // 2**20


def _read_os(system: Any, facts: WindowsFacts) -> None:
    if not isinstance(system, dict):
        return
    facts.os_name = _as_str(system.get("Caption"))
    facts.os_version = _as_str(system.get("Version"))


def _read_disks(disks: list[dict[str, Any]], facts: WindowsFacts, warnings: Warnings, file: str) -> None:
    for disk in disks:
        device = _as_str(disk.get("DeviceID"))
        if device is None:
            warnings.add(file, None, f"a LogicalDisk entry has no DeviceID: {shorten(json.dumps(disk))!r}")
            continue
        size, free = _as_int(disk.get("Size")), _as_int(disk.get("FreeSpace"))
        facts.disks.append(WindowsDisk(device.upper(), _as_str(disk.get("FileSystem")),
                                       None if size is None else size // 2**20,
                                       None if free is None else free // 2**20))
