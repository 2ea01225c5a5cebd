"""NVIDIA GPUs seen on the PCI bus, for a box whose driver is missing or not loaded.

A second-hand V100 box often arrives with no NVIDIA driver at all; nvidia-smi then prints nothing
and the probe would report a CPU-only box, so the planner would never place a model on the cards the
driver role is about to bring up. ``lspci -Dnn -d 10de:`` (pciutils) still lists them. Its lines
look like::

    0000:3b:00.0 3D controller [0302]: NVIDIA Corporation GV100GL [Tesla V100 PCIe 32GB] [10de:1db6] (rev a1)
    0000:3b:00.0 3D controller [0302]: Device [10de:1db6] (rev a1)        <- without the pci.ids database

Only display controllers count (class 03xx); the audio and USB functions some boards carry are
skipped. The device id names the V100 variant and its memory, so the plan does not depend on the
pci.ids database being installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from controller.stages.probe.text import Warnings, clean_lines, readable

FILE = "lspci.txt"

# Tesla V100 device ids (vendor 10de): name as nvidia-smi prints it, memory in MiB as it reports it.
V100_DEVICES: dict[str, tuple[str, int]] = {
    "1db1": ("Tesla V100-SXM2-16GB", 16384),
    "1db4": ("Tesla V100-PCIE-16GB", 16384),
    "1db5": ("Tesla V100-SXM2-32GB", 32768),
    "1db6": ("Tesla V100-PCIE-32GB", 32768),
    "1db7": ("Tesla V100-DGXS-32GB", 32768),
    "1db8": ("Tesla V100-SXM3-32GB", 32768),
    "1df6": ("Tesla V100S-PCIE-32GB", 32768),
}

_LINE = re.compile(
    r"^(?P<bus>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<cls>.*?)\s*\[(?P<code>[0-9a-fA-F]{4})\]:\s*(?P<desc>.*?)\s*"
    r"\[(?P<vendor>[0-9a-fA-F]{4}):(?P<device>[0-9a-fA-F]{4})\]")


@dataclass(frozen=True)
class PciGpu:
    pci_bus_id: str | None  # "00000000:3B:00.0", the form nvidia-smi prints; None when unknown
    device_id: str
    name: str
    memory_mib: int | None
    line: int


def _smi_bus_id(bus: str) -> str:
    domain, rest = bus.split(":", 1) if bus.count(":") == 2 else ("0", bus)
    return f"{int(domain or '0', 16):08X}:{rest.upper()}"


def parse_lspci(text: str, warnings: Warnings, file: str = FILE) -> list[PciGpu]:
    """NVIDIA display controllers in lspci -Dnn output, in bus order."""
    if not readable(text, warnings, file):
        return []
    found = []
    for line in clean_lines(text):
        match = _LINE.match(line.text.strip())
        if match is None:
            if line.text.strip():
                warnings.add(file, line.number, "not an lspci -nn line; ignored")
            continue
        if match["vendor"].lower() != "10de" or not match["code"].startswith("03"):
            continue
        bracketed = re.findall(r"\[([^\]]+)\]", match["desc"])
        found.append(pci_gpu(_smi_bus_id(match["bus"]), match["device"], bracketed[-1] if bracketed else None,
                             line.number))
    return sorted(found, key=lambda gpu: gpu.pci_bus_id or "")


def pci_gpu(bus_id: str | None, device: str, name: str | None, line: int = 0) -> PciGpu:
    """An NVIDIA card known by its PCI device id; a V100's name and memory come from the id."""
    device = device.lower()
    known = V100_DEVICES.get(device)
    if known:
        return PciGpu(bus_id, device, known[0], known[1], line)
    return PciGpu(bus_id, device, name or f"NVIDIA device 10de:{device}", None, line)
